//! The delivery and billing services' logic: what each does with `OrderCreated` and
//! `OrderCancelled`, written once and driven by any transport (NATS JetStream, Kafka, or the
//! demo's in-process bus) through [`outbox_inbox::InboxHandler`].
//!
//! - **delivery** reserves one delivery slot per order and releases it on cancellation;
//! - **billing** charges each order once and refunds it once on cancellation.
//!
//! Each service has its own database. For every message it begins a transaction, claims
//! `(event_id, service)` in its inbox, writes its effect as a row in its ledger and commits:
//! inbox row and effect together, or neither. A redelivered message finds its inbox row and is
//! skipped ([`Processed::Duplicate`]); the transport acks only after the commit.
//!
//! The ledgers are append-only and deliberately have **no** unique key on `(order_id, action)`:
//! the inbox is what keeps effects single, and the end-to-end checks count ledger rows per order
//! to prove it. (A production ledger would add the key as a second line of defence.)
//!
//! A cancellation that arrives before its order's creation was applied (possible when the
//! creation failed once and is being retried) is refused with a transient error, so the
//! transport delivers it again later instead of refunding a charge that does not exist yet.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use outbox_inbox::postgres::PgInbox;
use outbox_inbox::sqlite::SqliteInbox;
use outbox_inbox::{Delivery, InboxClaim, InboxHandler, ParkedMessage, Processed};
use outbox_types::routing::header;
use serde::Serialize;
use sqlx::{AssertSqlSafe, Transaction};
use uuid::Uuid;

use crate::Error;
use crate::db::{Db, Migration, migrate};
use crate::order::{ORDER_CANCELLED, ORDER_CREATED, OrderCancelled, OrderCreated};

/// Which consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Service {
    /// Reserves a delivery slot per order, releases it on cancellation.
    Delivery,
    /// Charges each order, refunds it on cancellation.
    Billing,
}

impl Service {
    /// The handler name in the inbox key, the durable consumer / group name, and the
    /// migration set name.
    ///
    /// ```
    /// assert_eq!(outbox_orders::consumers::Service::Billing.name(), "billing");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Service::Delivery => "delivery",
            Service::Billing => "billing",
        }
    }

    /// The ledger table.
    fn table(self) -> &'static str {
        match self {
            Service::Delivery => "delivery_slots",
            Service::Billing => "billing_ledger",
        }
    }

    /// The action written for `OrderCreated` and for `OrderCancelled`.
    pub fn actions(self) -> (Action, Action) {
        match self {
            Service::Delivery => (Action::Reserve, Action::Release),
            Service::Billing => (Action::Charge, Action::Refund),
        }
    }
}

/// One ledger row's meaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Delivery: a slot was reserved for the order.
    Reserve,
    /// Delivery: the slot was given back (cancellation).
    Release,
    /// Billing: the order was charged.
    Charge,
    /// Billing: the charge was refunded (cancellation).
    Refund,
}

impl Action {
    fn as_str(self) -> &'static str {
        match self {
            Action::Reserve => "reserve",
            Action::Release => "release",
            Action::Charge => "charge",
            Action::Refund => "refund",
        }
    }

    fn parse(s: &str) -> Result<Action, Error> {
        Ok(match s {
            "reserve" => Action::Reserve,
            "release" => Action::Release,
            "charge" => Action::Charge,
            "refund" => Action::Refund,
            other => return Err(Error::Invalid(format!("unknown ledger action `{other}`"))),
        })
    }
}

/// One row of a service's ledger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerEntry {
    /// The order it is about.
    pub order_id: Uuid,
    /// What was done.
    pub action: Action,
    /// Delivery: the quantity; billing: the amount in cents.
    pub value: i64,
}

/// Live counts of what a consumer did (read by the demo's summary).
#[derive(Debug, Default)]
pub struct ConsumerCounters {
    /// Effects of `OrderCreated` applied (slots reserved / charges).
    pub opened: AtomicU64,
    /// Effects of `OrderCancelled` applied (slots released / refunds).
    pub closed: AtomicU64,
    /// Messages skipped because the inbox had seen their event already.
    pub duplicates: AtomicU64,
    /// Events of other types, recorded in the inbox without an effect.
    pub ignored: AtomicU64,
    /// Messages given up on and written to the parked table.
    pub parked: AtomicU64,
}

/// An order event as a consumer reads it off a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OrderMessage {
    /// `OrderCreated`.
    Created(OrderCreated),
    /// `OrderCancelled`.
    Cancelled(OrderCancelled),
    /// Another event type (recorded, no effect).
    Other(String),
}

impl OrderMessage {
    /// Read the event type from the `outbox-event-type` header and parse the payload. A
    /// missing header or a payload that does not fit is [`outbox_inbox::Error::BadMessage`]
    /// (not transient: the adapters park it at once).
    pub fn from_delivery(delivery: &Delivery) -> Result<OrderMessage, outbox_inbox::Error> {
        let event_type = delivery
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(header::EVENT_TYPE))
            .map(|(_, v)| v.as_str())
            .ok_or_else(|| {
                outbox_inbox::Error::BadMessage(format!(
                    "the message has no `{}` header",
                    header::EVENT_TYPE
                ))
            })?;
        Ok(match event_type {
            ORDER_CREATED => OrderMessage::Created(delivery.json()?),
            ORDER_CANCELLED => OrderMessage::Cancelled(delivery.json()?),
            other => OrderMessage::Other(other.to_owned()),
        })
    }
}

/// The cancellation came before the creation was applied; transient, try again later.
#[derive(Debug, thiserror::Error)]
#[error("order {0} was cancelled before its creation reached this service; retrying later")]
struct CreationNotSeenYet(Uuid);

enum ConsumerDb {
    Postgres {
        pool: sqlx::PgPool,
        inbox: PgInbox,
    },
    Sqlite {
        pool: sqlx::SqlitePool,
        inbox: SqliteInbox,
    },
}

/// A delivery or billing consumer over its own database: an [`InboxHandler`] for any
/// transport.
pub struct Consumer {
    service: Service,
    db: ConsumerDb,
    counters: Arc<ConsumerCounters>,
}

/// What one applied message did.
enum Effect {
    Opened,
    Closed,
    Ignored,
}

impl Consumer {
    /// The consumer `service` over `db`: creates or upgrades its ledger and its inbox (table
    /// `inbox`, in the connection's current schema on PostgreSQL).
    pub async fn open(service: Service, db: Db) -> Result<Consumer, Error> {
        let ledger = ledger_migrations(service);
        migrate(&db, service.name(), &ledger).await?;
        let db = match db {
            Db::Postgres(pool) => {
                let schema: String = sqlx::query_scalar("SELECT current_schema()::TEXT")
                    .fetch_one(&pool)
                    .await?;
                let inbox = PgInbox::with_names(&schema, "inbox")?;
                inbox.migrate(&pool).await?;
                ConsumerDb::Postgres { pool, inbox }
            }
            Db::Sqlite(pool) => {
                let inbox = SqliteInbox::with_table("inbox")?;
                inbox.migrate(&pool).await?;
                ConsumerDb::Sqlite { pool, inbox }
            }
        };
        Ok(Consumer {
            service,
            db,
            counters: Arc::new(ConsumerCounters::default()),
        })
    }

    /// Which service this is.
    pub fn service(&self) -> Service {
        self.service
    }

    /// Live counters.
    pub fn counters(&self) -> Arc<ConsumerCounters> {
        self.counters.clone()
    }

    /// Every ledger row, oldest first.
    pub async fn ledger(&self) -> Result<Vec<LedgerEntry>, Error> {
        let sql = format!(
            "SELECT order_id, action, value FROM {} ORDER BY id",
            self.service.table()
        );
        let rows: Vec<(String, String, i64)> = match &self.db {
            ConsumerDb::Postgres { pool, .. } => {
                sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await?
            }
            ConsumerDb::Sqlite { pool, .. } => {
                sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await?
            }
        };
        rows.into_iter()
            .map(|(order_id, action, value)| {
                Ok(LedgerEntry {
                    order_id: Uuid::parse_str(&order_id).map_err(|e| {
                        Error::Invalid(format!("ledger order id `{order_id}`: {e}"))
                    })?,
                    action: Action::parse(&action)?,
                    value,
                })
            })
            .collect()
    }

    /// How many messages this service parked (all time).
    pub async fn parked_count(&self) -> Result<u64, Error> {
        let n = match &self.db {
            ConsumerDb::Postgres { pool, inbox } => {
                inbox.parked(pool, self.service.name(), 10_000).await?.len()
            }
            ConsumerDb::Sqlite { pool, inbox } => {
                inbox.parked(pool, self.service.name(), 10_000).await?.len()
            }
        };
        Ok(n as u64)
    }

    /// Close the pool.
    pub async fn close(&self) {
        match &self.db {
            ConsumerDb::Postgres { pool, .. } => pool.close().await,
            ConsumerDb::Sqlite { pool, .. } => pool.close().await,
        }
    }

    fn insert_sql(&self, dialect: Dialect) -> AssertSqlSafe<String> {
        let t = self.service.table();
        AssertSqlSafe(match dialect {
            Dialect::Postgres => format!(
                "INSERT INTO {t} (order_id, action, value, event_id) VALUES ($1, $2, $3, $4)"
            ),
            Dialect::Sqlite => format!(
                "INSERT INTO {t} (order_id, action, value, event_id) VALUES (?1, ?2, ?3, ?4)"
            ),
        })
    }

    fn opened_sql(&self, dialect: Dialect) -> AssertSqlSafe<String> {
        let t = self.service.table();
        AssertSqlSafe(match dialect {
            Dialect::Postgres => {
                format!("SELECT COUNT(*) FROM {t} WHERE order_id = $1 AND action = $2")
            }
            Dialect::Sqlite => {
                format!("SELECT COUNT(*) FROM {t} WHERE order_id = ?1 AND action = ?2")
            }
        })
    }

    /// The row to write for `message`, or `None` for events without an effect.
    fn plan(&self, message: &OrderMessage) -> Option<(Uuid, Action, i64, bool)> {
        let (open, close) = self.service.actions();
        match message {
            OrderMessage::Created(c) => {
                let value = match self.service {
                    Service::Delivery => c.quantity,
                    Service::Billing => c.amount_cents,
                };
                Some((c.order_id, open, value, false))
            }
            OrderMessage::Cancelled(c) => {
                let value = match self.service {
                    Service::Delivery => 0,
                    Service::Billing => c.amount_cents,
                };
                Some((c.order_id, close, value, true))
            }
            OrderMessage::Other(_) => None,
        }
    }

    /// Write `message`'s effect in `tx`: one ledger row, after checking that a cancellation's
    /// order was opened here first. One body for both databases; only the SQL text differs.
    async fn apply<DB>(
        &self,
        tx: &mut Transaction<'static, DB>,
        dialect: Dialect,
        delivery: &Delivery,
        message: &OrderMessage,
    ) -> Result<Effect, outbox_inbox::Error>
    where
        DB: sqlx::Database,
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
        DB::Arguments: sqlx::IntoArguments<DB>,
        String: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        &'static str: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        i64: for<'q> sqlx::Encode<'q, DB> + sqlx::Type<DB>,
        (i64,): for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        let Some((order_id, action, value, closes)) = self.plan(message) else {
            return Ok(Effect::Ignored);
        };
        if closes {
            let (open, _) = self.service.actions();
            let seen: i64 = sqlx::query_scalar(self.opened_sql(dialect))
                .bind(order_id.to_string())
                .bind(open.as_str())
                .fetch_one(&mut **tx)
                .await?;
            if seen == 0 {
                return Err(outbox_inbox::Error::Handler(Box::new(CreationNotSeenYet(
                    order_id,
                ))));
            }
        }
        sqlx::query(self.insert_sql(dialect))
            .bind(order_id.to_string())
            .bind(action.as_str())
            .bind(value)
            .bind(delivery.event_id.to_string())
            .execute(&mut **tx)
            .await?;
        Ok(if closes {
            Effect::Closed
        } else {
            Effect::Opened
        })
    }
}

#[derive(Clone, Copy)]
enum Dialect {
    Postgres,
    Sqlite,
}

#[async_trait]
impl InboxHandler for Consumer {
    async fn handle(&self, delivery: &Delivery) -> Result<Processed<()>, outbox_inbox::Error> {
        let message = OrderMessage::from_delivery(delivery)?;
        let name = self.service.name();
        // Claim, then write the effect in the same transaction (`None`: a duplicate, rolled
        // back). A macro: the two databases' transactions and inboxes are different types.
        macro_rules! claim_then_apply {
            ($begin:expr, $inbox:expr, $dialect:expr) => {{
                let mut tx = $begin.await?;
                if $inbox.claim(&mut *tx, delivery.event_id, name).await? == InboxClaim::Duplicate {
                    None
                } else {
                    let effect = self.apply(&mut tx, $dialect, delivery, &message).await?;
                    tx.commit().await?;
                    Some(effect)
                }
            }};
        }
        let effect = match &self.db {
            ConsumerDb::Postgres { pool, inbox } => {
                claim_then_apply!(pool.begin(), inbox, Dialect::Postgres)
            }
            ConsumerDb::Sqlite { pool, inbox } => {
                // BEGIN IMMEDIATE: the claim writes first anyway; taking the write lock up
                // front keeps a concurrent writer from turning this into SQLITE_BUSY.
                claim_then_apply!(pool.begin_with("BEGIN IMMEDIATE"), inbox, Dialect::Sqlite)
            }
        };
        let c = &self.counters;
        Ok(match effect {
            None => {
                c.duplicates.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(service = name, event_id = %delivery.event_id, "Duplicate delivery skipped.");
                Processed::Duplicate
            }
            Some(effect) => {
                let counter = match effect {
                    Effect::Opened => &c.opened,
                    Effect::Closed => &c.closed,
                    Effect::Ignored => &c.ignored,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                Processed::Applied(())
            }
        })
    }

    async fn park(&self, message: &ParkedMessage) -> Result<(), outbox_inbox::Error> {
        let name = self.service.name();
        match &self.db {
            ConsumerDb::Postgres { pool, inbox } => inbox.park(pool, name, message).await?,
            ConsumerDb::Sqlite { pool, inbox } => inbox.park(pool, name, message).await?,
        }
        self.counters.parked.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// A ledger table in both dialects: the delivery slots and the billing ledger are one table
/// (an append-only row per action on an order, see the module docs) under other names. A macro
/// so the SQL stays `&'static str`, the text of both migrations byte for byte what their
/// checksums recorded.
macro_rules! ledger_sql {
    ($table:literal, $value:literal, $actions:literal) => {
        (
            concat!(
                "\n-- value = ",
                $value,
                ". Append-only; no unique key on (order_id, action): see the\n",
                "-- module docs of outbox_orders::consumers.\n",
                "CREATE TABLE ",
                $table,
                r#" (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id    TEXT NOT NULL,
    action      TEXT NOT NULL CHECK (action IN ("#,
                $actions,
                r#")),
    value       BIGINT NOT NULL,
    event_id    TEXT NOT NULL,
    recorded_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX "#,
                $table,
                "_order ON ",
                $table,
                " (order_id, action);\n",
            ),
            concat!(
                "\nCREATE TABLE ",
                $table,
                r#" (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id    TEXT NOT NULL,
    action      TEXT NOT NULL CHECK (action IN ("#,
                $actions,
                r#")),
    value       INTEGER NOT NULL,
    event_id    TEXT NOT NULL,
    recorded_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
) STRICT;
CREATE INDEX "#,
                $table,
                "_order ON ",
                $table,
                " (order_id, action);\n",
            ),
        )
    };
}

fn ledger_migrations(service: Service) -> [Migration; 1] {
    let (postgres, sqlite) = match service {
        Service::Delivery => ledger_sql!(
            "delivery_slots",
            "the quantity to deliver",
            "'reserve', 'release'"
        ),
        Service::Billing => ledger_sql!(
            "billing_ledger",
            "the amount in cents",
            "'charge', 'refund'"
        ),
    };
    [Migration {
        version: 1,
        description: "ledger",
        postgres,
        sqlite,
    }]
}

/// Headers of an outbox event as a broker would carry them (the demo's bus builds deliveries
/// with these, so consumers read the same names on every transport).
pub fn event_headers(event: &outbox_types::Event) -> BTreeMap<String, String> {
    let mut headers = BTreeMap::new();
    headers.insert(header::EVENT_ID.to_owned(), event.id.to_string());
    headers.insert(header::EVENT_TYPE.to_owned(), event.event_type.clone());
    headers.insert(
        header::AGGREGATE_TYPE.to_owned(),
        event.aggregate_type.clone(),
    );
    headers.insert(header::AGGREGATE_ID.to_owned(), event.aggregate_id.clone());
    headers
}
