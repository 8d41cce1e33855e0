//! Orders: the request a client sends, its validation, the row, the events, and the store that
//! writes a state change and its event in one transaction.
//!
//! Why validation reads a `serde_json::Value` instead of deriving `Deserialize`: a derived
//! struct fails on the first problem with a message that names a line and column, not a field.
//! Clients get `{"error": "...", "field": "quantity"}` from here, and the rules (positive
//! quantity, non-empty product, non-negative amount with cents, no unknown fields) live in one
//! function that tests can call without a server.
//!
//! Why a credit limit: it is the one business rule decided *inside* the transaction, after the
//! order row and its `OrderCreated` event were written. Breaking it rolls both back, so the demo
//! and the tests show a rolled-back event never reaching a consumer, not only invalid requests
//! that never got that far. (On SQLite, whose single writer serializes the transactions, the
//! limit is exact; on PostgreSQL under read committed, two concurrent orders of one customer can
//! both pass the check — a real service would lock a customer row first. It is a demonstration
//! of rollback, not a credit system.)

use chrono::{DateTime, SubsecRound, Utc};
use outbox_postgresql::PgStore;
use outbox_sqlite::SqliteStore;
use outbox_types::{NewEvent, StoreError};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::Row;
use uuid::Uuid;

use crate::Error;
use crate::db::{Db, Migration, migrate};

/// The aggregate type of every order event.
pub const AGGREGATE_TYPE: &str = "order";
/// Event type written when an order is created.
pub const ORDER_CREATED: &str = "OrderCreated";
/// Event type written when an order is cancelled.
pub const ORDER_CANCELLED: &str = "OrderCancelled";
/// Price per unit when a request names no amount: 10.00.
pub const DEFAULT_UNIT_PRICE_CENTS: i64 = 1_000;
/// Most a customer may have in open (not cancelled) orders: 10,000.00.
pub const CREDIT_LIMIT_CENTS: i64 = 1_000_000;
/// Largest quantity one order may ask for.
pub const MAX_QUANTITY: i64 = 1_000;
/// Largest amount one order may have: 100,000.00.
pub const MAX_AMOUNT_CENTS: i64 = 10_000_000;
/// Longest product or customer name, in characters.
pub const MAX_NAME_CHARS: usize = 200;

/// Where an order is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    /// Created and not cancelled: delivery holds a slot, billing charged it.
    Created,
    /// Cancelled: the slot is released and the charge refunded.
    Cancelled,
}

impl OrderStatus {
    fn parse(s: &str) -> Result<Self, Error> {
        match s {
            "created" => Ok(OrderStatus::Created),
            "cancelled" => Ok(OrderStatus::Cancelled),
            other => Err(Error::Invalid(format!("unknown order status `{other}`"))),
        }
    }
}

/// An order as stored and as returned by the HTTP API.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Order {
    /// Assigned by the service (UUID v7: time-ordered).
    pub id: Uuid,
    /// What was ordered.
    pub product: String,
    /// How many.
    pub quantity: i64,
    /// Who ordered it, when the client said so (the credit limit applies per customer).
    pub customer: Option<String>,
    /// The total in cents (integers: money is never a float in storage).
    pub amount_cents: i64,
    /// The total as a decimal number of currency units, for people reading the JSON.
    pub amount: f64,
    /// Created or cancelled.
    pub status: OrderStatus,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it was cancelled.
    pub cancelled_at: Option<DateTime<Utc>>,
}

/// The payload of `OrderCreated`: what delivery and billing need, nothing more.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCreated {
    /// The order.
    pub order_id: Uuid,
    /// What to deliver.
    pub product: String,
    /// How many.
    pub quantity: i64,
    /// Who to bill.
    pub customer: Option<String>,
    /// What to charge, in cents.
    pub amount_cents: i64,
    /// When the order was created.
    pub created_at: DateTime<Utc>,
}

/// The payload of `OrderCancelled`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCancelled {
    /// The order.
    pub order_id: Uuid,
    /// What to refund, in cents.
    pub amount_cents: i64,
    /// When it was cancelled.
    pub cancelled_at: DateTime<Utc>,
}

/// A valid request to create an order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewOrder {
    /// Non-empty, trimmed.
    pub product: String,
    /// 1 ..= [`MAX_QUANTITY`].
    pub quantity: i64,
    /// Non-empty when given.
    pub customer: Option<String>,
    /// 0 ..= [`MAX_AMOUNT_CENTS`]; quantity × [`DEFAULT_UNIT_PRICE_CENTS`] when not given.
    pub amount_cents: i64,
}

/// Why a create request was refused before anything was written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON, or not a JSON object.
    #[error("{0}")]
    Malformed(String),
    /// A field is missing, of the wrong type, or out of range.
    #[error("{message}")]
    Invalid {
        /// The field at fault.
        field: String,
        /// What is wrong with it, in words a client developer understands.
        message: String,
    },
}

fn invalid(field: &str, message: impl Into<String>) -> RequestError {
    RequestError::Invalid {
        field: field.to_owned(),
        message: message.into(),
    }
}

impl NewOrder {
    /// Parse and validate a `POST /orders` body.
    ///
    /// ```
    /// use outbox_orders::order::{NewOrder, RequestError};
    /// let ok = NewOrder::from_json(br#"{"product": "lamp", "quantity": 2, "amount": 19.99}"#).unwrap();
    /// assert_eq!(ok.amount_cents, 1999);
    /// let err = NewOrder::from_json(br#"{"product": "lamp", "quantity": 0}"#).unwrap_err();
    /// assert!(matches!(err, RequestError::Invalid { field, .. } if field == "quantity"));
    /// ```
    pub fn from_json(body: &[u8]) -> Result<NewOrder, RequestError> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| RequestError::Malformed(format!("the body is not valid JSON: {e}")))?;
        let Value::Object(fields) = value else {
            return Err(RequestError::Malformed(
                "the body must be a JSON object such as {\"product\": \"lamp\", \"quantity\": 1}"
                    .to_owned(),
            ));
        };
        if let Some(unknown) = fields
            .keys()
            .find(|k| !matches!(k.as_str(), "product" | "quantity" | "customer" | "amount"))
        {
            return Err(invalid(
                unknown,
                format!("unknown field `{unknown}`; expected product, quantity, customer, amount"),
            ));
        }

        let product = match fields.get("product") {
            None | Some(Value::Null) => return Err(invalid("product", "product is required")),
            Some(Value::String(s)) => s.trim().to_owned(),
            Some(_) => return Err(invalid("product", "product must be a string")),
        };
        if product.is_empty() {
            return Err(invalid("product", "product must not be empty"));
        }
        if product.chars().count() > MAX_NAME_CHARS {
            return Err(invalid(
                "product",
                format!("product must be at most {MAX_NAME_CHARS} characters"),
            ));
        }

        let quantity = match fields.get("quantity") {
            None | Some(Value::Null) => return Err(invalid("quantity", "quantity is required")),
            Some(Value::Number(n)) => match n.as_i64() {
                Some(q) => q,
                None if n.as_u64().is_some() => i64::MAX,
                None => return Err(invalid("quantity", "quantity must be a whole number")),
            },
            Some(_) => return Err(invalid("quantity", "quantity must be a number")),
        };
        if quantity < 1 {
            return Err(invalid("quantity", "quantity must be at least 1"));
        }
        if quantity > MAX_QUANTITY {
            return Err(invalid(
                "quantity",
                format!("quantity must be at most {MAX_QUANTITY}"),
            ));
        }

        let customer = match fields.get("customer") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.trim().is_empty() => {
                return Err(invalid(
                    "customer",
                    "customer must not be empty (leave it out instead)",
                ));
            }
            Some(Value::String(s)) if s.trim().chars().count() > MAX_NAME_CHARS => {
                return Err(invalid(
                    "customer",
                    format!("customer must be at most {MAX_NAME_CHARS} characters"),
                ));
            }
            Some(Value::String(s)) => Some(s.trim().to_owned()),
            Some(_) => return Err(invalid("customer", "customer must be a string")),
        };

        let amount_cents = match fields.get("amount") {
            None | Some(Value::Null) => quantity * DEFAULT_UNIT_PRICE_CENTS,
            Some(Value::Number(n)) => {
                let amount = n.as_f64().unwrap_or(f64::NAN);
                if !amount.is_finite() {
                    return Err(invalid("amount", "amount must be a finite number"));
                }
                if amount < 0.0 {
                    return Err(invalid("amount", "amount must not be negative"));
                }
                let cents = (amount * 100.0).round();
                if (amount * 100.0 - cents).abs() > 1e-6 {
                    return Err(invalid(
                        "amount",
                        "amount must have at most two decimal places",
                    ));
                }
                if cents > MAX_AMOUNT_CENTS as f64 {
                    return Err(invalid(
                        "amount",
                        format!("amount must be at most {}", MAX_AMOUNT_CENTS / 100),
                    ));
                }
                cents as i64
            }
            Some(_) => return Err(invalid("amount", "amount must be a number")),
        };

        Ok(NewOrder {
            product,
            quantity,
            customer,
            amount_cents,
        })
    }
}

/// What [`OrderStore::create`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum Created {
    /// The order and its `OrderCreated` event committed together.
    Order(Order),
    /// The customer's open orders would exceed [`CREDIT_LIMIT_CENTS`]; the order row and its
    /// event were written and then rolled back: neither exists.
    CreditLimitExceeded {
        /// Open orders of the customer including this one, in cents.
        open_cents: i64,
    },
}

/// What [`OrderStore::cancel`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum Cancelled {
    /// The order was open; it is cancelled now and `OrderCancelled` committed with it.
    Now(Order),
    /// It was cancelled before; nothing was written.
    Already(Order),
    /// No such order.
    NotFound,
}

/// The orders table of the order service, and the outbox in the same database.
#[derive(Clone, Debug)]
pub enum OrderStore {
    /// PostgreSQL: `orders` in the connection's schema, the outbox where `PgOutbox` says.
    Postgres(PgStore),
    /// SQLite: `orders` and the outbox table in one file.
    Sqlite(SqliteStore),
}

const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "orders table",
    postgres: r#"
CREATE TABLE orders (
    id           UUID PRIMARY KEY,
    product      TEXT NOT NULL,
    quantity     BIGINT NOT NULL CHECK (quantity > 0),
    customer     TEXT,
    amount_cents BIGINT NOT NULL CHECK (amount_cents >= 0),
    status       TEXT NOT NULL CHECK (status IN ('created', 'cancelled')),
    created_at   TIMESTAMPTZ NOT NULL,
    cancelled_at TIMESTAMPTZ
);
-- The credit limit sums a customer's open orders.
CREATE INDEX orders_customer_open ON orders (customer) WHERE status = 'created';
"#,
    sqlite: r#"
CREATE TABLE orders (
    id           TEXT PRIMARY KEY,
    product      TEXT NOT NULL,
    quantity     INTEGER NOT NULL CHECK (quantity > 0),
    customer     TEXT,
    amount_cents INTEGER NOT NULL CHECK (amount_cents >= 0),
    status       TEXT NOT NULL CHECK (status IN ('created', 'cancelled')),
    -- RFC 3339 UTC.
    created_at   TEXT NOT NULL,
    cancelled_at TEXT
) STRICT;
CREATE INDEX orders_customer_open ON orders (customer) WHERE status = 'created';
"#,
}];

const COLUMNS: &str =
    "id, product, quantity, customer, amount_cents, status, created_at, cancelled_at";

/// The steps of [`OrderStore::create`] in an open transaction `$tx` of store `$s`: insert the
/// order (id and creation time bound as the dialect stores them), enqueue `$event`, sum the
/// customer's open orders with `$open_sql` and roll back past the credit limit, else commit;
/// the open sum is the value. A macro because the two stores' transactions are different types.
macro_rules! create_in {
    ($s:expr, $tx:expr, $insert_sql:expr, $id_bind:expr, $created_bind:expr, $open_sql:expr, $order:expr, $event:expr) => {{
        let mut tx = $tx;
        sqlx::query($insert_sql)
            .bind($id_bind)
            .bind(&$order.product)
            .bind($order.quantity)
            .bind(&$order.customer)
            .bind($order.amount_cents)
            .bind($created_bind)
            .execute(&mut *tx)
            .await?;
        $s.outbox().enqueue(&mut *tx, &$event).await?;
        let open: i64 = match &$order.customer {
            Some(customer) => {
                sqlx::query_scalar($open_sql)
                    .bind(customer)
                    .fetch_one(&mut *tx)
                    .await?
            }
            None => 0,
        };
        if open > CREDIT_LIMIT_CENTS {
            tx.rollback().await?;
            return Ok(Created::CreditLimitExceeded { open_cents: open });
        }
        tx.commit().await?;
        open
    }};
}

/// The steps of [`OrderStore::cancel`] in an open transaction `$tx` of store `$s`: run the
/// status-guarded update with the id and time bound as the dialect stores them; no row back
/// means already cancelled (or no such order); else enqueue `OrderCancelled` and commit. A
/// macro because the two stores' transactions and rows are different types.
macro_rules! cancel_in {
    ($store:expr, $s:expr, $tx:expr, $sql:expr, $id_bind:expr, $now_bind:expr, $decode:expr, $id:expr) => {{
        let mut tx = $tx;
        let row = sqlx::query($sql)
            .bind($id_bind)
            .bind($now_bind)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = row else {
            drop(tx);
            return Ok(match $store.get($id).await? {
                Some(order) => Cancelled::Already(order),
                None => Cancelled::NotFound,
            });
        };
        let order = $decode(&row)?;
        $s.outbox()
            .enqueue(&mut *tx, &cancelled_event(&order)?)
            .await?;
        tx.commit().await?;
        Ok(Cancelled::Now(order))
    }};
}

impl OrderStore {
    /// The store over `db`, with the outbox table at its default place (`outbox.events` on
    /// PostgreSQL, `outbox_events` on SQLite) or where `outbox_pg` says.
    pub fn new(db: Db, outbox_pg: Option<outbox_postgresql::PgOutbox>) -> Self {
        match db {
            Db::Postgres(pool) => {
                OrderStore::Postgres(PgStore::new(pool, outbox_pg.unwrap_or_default()))
            }
            Db::Sqlite(pool) => {
                OrderStore::Sqlite(SqliteStore::new(pool, outbox_sqlite::SqliteOutbox::new()))
            }
        }
    }

    /// Create or upgrade the orders table and the outbox (both idempotent).
    pub async fn migrate(&self) -> Result<(), Error> {
        migrate(&self.db(), "orders", MIGRATIONS).await?;
        match self {
            OrderStore::Postgres(s) => {
                s.outbox().migrate(s.pool()).await?;
            }
            OrderStore::Sqlite(s) => {
                s.outbox().migrate(s.pool()).await?;
            }
        }
        Ok(())
    }

    /// The database.
    pub fn db(&self) -> Db {
        match self {
            OrderStore::Postgres(s) => Db::Postgres(s.pool().clone()),
            OrderStore::Sqlite(s) => Db::Sqlite(s.pool().clone()),
        }
    }

    /// The outbox as a relay sees it (for the in-process relay of the demo and tests).
    pub fn relay_store(&self) -> std::sync::Arc<dyn outbox_types::Store> {
        match self {
            OrderStore::Postgres(s) => std::sync::Arc::new(s.clone()),
            OrderStore::Sqlite(s) => std::sync::Arc::new(s.clone()),
        }
    }

    /// Insert the order and enqueue `OrderCreated` in one transaction; then check the
    /// customer's credit limit in the same transaction and roll both back if it is exceeded.
    pub async fn create(&self, new: &NewOrder) -> Result<Created, Error> {
        let now = Utc::now().trunc_subsecs(6);
        let order = Order {
            id: Uuid::now_v7(),
            product: new.product.clone(),
            quantity: new.quantity,
            customer: new.customer.clone(),
            amount_cents: new.amount_cents,
            amount: new.amount_cents as f64 / 100.0,
            status: OrderStatus::Created,
            created_at: now,
            cancelled_at: None,
        };
        let event = created_event(&order)?;
        let open_cents: i64 = match self {
            OrderStore::Postgres(s) => {
                let tx = s.pool().begin().await?;
                create_in!(
                    s,
                    tx,
                    "INSERT INTO orders (id, product, quantity, customer, amount_cents, status, created_at)
                     VALUES ($1, $2, $3, $4, $5, 'created', $6)",
                    order.id,
                    order.created_at,
                    "SELECT COALESCE(SUM(amount_cents), 0)::BIGINT FROM orders
                         WHERE customer = $1 AND status = 'created'",
                    order,
                    event
                )
            }
            OrderStore::Sqlite(s) => {
                let tx = s.pool().begin_with("BEGIN IMMEDIATE").await?;
                create_in!(
                    s,
                    tx,
                    "INSERT INTO orders (id, product, quantity, customer, amount_cents, status, created_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, 'created', ?6)",
                    order.id.to_string(),
                    order.created_at.to_rfc3339(),
                    "SELECT COALESCE(SUM(amount_cents), 0) FROM orders
                         WHERE customer = ?1 AND status = 'created'",
                    order,
                    event
                )
            }
        };
        tracing::debug!(order_id = %order.id, open_cents, "Order created.");
        Ok(Created::Order(order))
    }

    /// Cancel the order `id` if it is open, writing `OrderCancelled` in the same transaction.
    /// The update is guarded by the status, so of two concurrent cancels exactly one writes the
    /// event; the other (and any later one) gets [`Cancelled::Already`].
    pub async fn cancel(&self, id: Uuid) -> Result<Cancelled, Error> {
        let now = Utc::now().trunc_subsecs(6);
        match self {
            OrderStore::Postgres(s) => {
                let tx = s.pool().begin().await?;
                cancel_in!(self, s, tx, CancelSql::pg_cancel(), id, now, pg_order, id)
            }
            OrderStore::Sqlite(s) => {
                let tx = s.pool().begin_with("BEGIN IMMEDIATE").await?;
                cancel_in!(
                    self,
                    s,
                    tx,
                    CancelSql::sqlite_cancel(),
                    id.to_string(),
                    now.to_rfc3339(),
                    sqlite_order,
                    id
                )
            }
        }
    }

    /// The order `id`, if it exists.
    pub async fn get(&self, id: Uuid) -> Result<Option<Order>, Error> {
        match self {
            OrderStore::Postgres(s) => {
                let row = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {COLUMNS} FROM orders WHERE id = $1"
                )))
                .bind(id)
                .fetch_optional(s.pool())
                .await?;
                row.as_ref().map(pg_order).transpose()
            }
            OrderStore::Sqlite(s) => {
                let row = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {COLUMNS} FROM orders WHERE id = ?1"
                )))
                .bind(id.to_string())
                .fetch_optional(s.pool())
                .await?;
                row.as_ref().map(sqlite_order).transpose()
            }
        }
    }

    /// `columns` (an SQL select list that reads the same on both databases, e.g. the id as
    /// `CAST(id AS TEXT)`) of every row of the outbox table, in write order: what the demo and
    /// the tests compare with what the consumers saw. The table's name is the only part that
    /// differs per database.
    pub async fn outbox_rows<T>(&self, columns: &str) -> Result<Vec<T>, Error>
    where
        T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>
            + for<'r> sqlx::FromRow<'r, sqlx::sqlite::SqliteRow>
            + Send
            + Unpin,
    {
        let select = |table: &str| format!("SELECT {columns} FROM {table} ORDER BY seq");
        let rows = match self {
            OrderStore::Postgres(s) => {
                sqlx::query_as(sqlx::AssertSqlSafe(select(s.outbox().qualified_table())))
                    .fetch_all(s.pool())
                    .await?
            }
            OrderStore::Sqlite(s) => {
                sqlx::query_as(sqlx::AssertSqlSafe(select(s.outbox().quoted_table())))
                    .fetch_all(s.pool())
                    .await?
            }
        };
        Ok(rows)
    }

    /// Every order's id and status (for the end-to-end checks).
    pub async fn statuses(&self) -> Result<Vec<(Uuid, OrderStatus)>, Error> {
        let rows: Vec<(String, String)> = match self {
            OrderStore::Postgres(s) => {
                sqlx::query_as("SELECT id::TEXT, status FROM orders")
                    .fetch_all(s.pool())
                    .await?
            }
            OrderStore::Sqlite(s) => {
                sqlx::query_as("SELECT id, status FROM orders")
                    .fetch_all(s.pool())
                    .await?
            }
        };
        rows.into_iter()
            .map(|(id, status)| Ok((parse_uuid(&id)?, OrderStatus::parse(&status)?)))
            .collect()
    }
}

/// The guarded cancel statements (kept together so both dialects say the same thing).
struct CancelSql;

impl CancelSql {
    fn pg_cancel() -> sqlx::AssertSqlSafe<String> {
        sqlx::AssertSqlSafe(format!(
            "UPDATE orders SET status = 'cancelled', cancelled_at = $2
             WHERE id = $1 AND status = 'created' RETURNING {COLUMNS}"
        ))
    }

    fn sqlite_cancel() -> sqlx::AssertSqlSafe<String> {
        sqlx::AssertSqlSafe(format!(
            "UPDATE orders SET status = 'cancelled', cancelled_at = ?2
             WHERE id = ?1 AND status = 'created' RETURNING {COLUMNS}"
        ))
    }
}

fn created_event(order: &Order) -> Result<NewEvent, Error> {
    let payload = OrderCreated {
        order_id: order.id,
        product: order.product.clone(),
        quantity: order.quantity,
        customer: order.customer.clone(),
        amount_cents: order.amount_cents,
        created_at: order.created_at,
    };
    order_event(order, ORDER_CREATED, &payload, order.created_at, "created")
}

fn cancelled_event(order: &Order) -> Result<NewEvent, Error> {
    let cancelled_at = order.cancelled_at.unwrap_or_else(Utc::now);
    let payload = OrderCancelled {
        order_id: order.id,
        amount_cents: order.amount_cents,
        cancelled_at,
    };
    order_event(order, ORDER_CANCELLED, &payload, cancelled_at, "cancelled")
}

/// An event of `order`'s aggregate: `event_type` with `payload`, occurred at `at`, keyed
/// `order-<id>-<step>` so the same step of the same order is never enqueued twice.
fn order_event(
    order: &Order,
    event_type: &str,
    payload: &impl Serialize,
    at: DateTime<Utc>,
    step: &str,
) -> Result<NewEvent, Error> {
    Ok(
        NewEvent::new(AGGREGATE_TYPE, order.id.to_string(), event_type, payload)
            .map_err(StoreError::from)?
            .with_occurred_at(at)
            .with_idempotency_key(format!("order-{}-{step}", order.id)),
    )
}

fn pg_order(row: &sqlx::postgres::PgRow) -> Result<Order, Error> {
    let amount_cents: i64 = row.try_get("amount_cents")?;
    Ok(Order {
        id: row.try_get("id")?,
        product: row.try_get("product")?,
        quantity: row.try_get("quantity")?,
        customer: row.try_get("customer")?,
        amount_cents,
        amount: amount_cents as f64 / 100.0,
        status: OrderStatus::parse(row.try_get("status")?)?,
        created_at: row.try_get("created_at")?,
        cancelled_at: row.try_get("cancelled_at")?,
    })
}

fn sqlite_order(row: &sqlx::sqlite::SqliteRow) -> Result<Order, Error> {
    let amount_cents: i64 = row.try_get("amount_cents")?;
    let created_at: String = row.try_get("created_at")?;
    let cancelled_at: Option<String> = row.try_get("cancelled_at")?;
    Ok(Order {
        id: parse_uuid(row.try_get("id")?)?,
        product: row.try_get("product")?,
        quantity: row.try_get("quantity")?,
        customer: row.try_get("customer")?,
        amount_cents,
        amount: amount_cents as f64 / 100.0,
        status: OrderStatus::parse(row.try_get("status")?)?,
        created_at: parse_time(&created_at)?,
        cancelled_at: cancelled_at.as_deref().map(parse_time).transpose()?,
    })
}

fn parse_uuid(s: &str) -> Result<Uuid, Error> {
    Uuid::parse_str(s).map_err(|e| Error::Invalid(format!("stored order id `{s}`: {e}")))
}

fn parse_time(s: &str) -> Result<DateTime<Utc>, Error> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| Error::Invalid(format!("stored time `{s}`: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(body: &str) -> String {
        match NewOrder::from_json(body.as_bytes()) {
            Err(RequestError::Invalid { field, .. }) => field,
            other => panic!("{body}: expected a field error, got {other:?}"),
        }
    }

    #[test]
    fn valid_requests() {
        let o = NewOrder::from_json(br#"{"product":" lamp ","quantity":3}"#).unwrap();
        assert_eq!(o.product, "lamp");
        assert_eq!(o.amount_cents, 3 * DEFAULT_UNIT_PRICE_CENTS);
        assert_eq!(o.customer, None);
        let o = NewOrder::from_json(
            br#"{"product":"lamp","quantity":1,"customer":"ann","amount":0.1}"#,
        )
        .unwrap();
        assert_eq!(o.amount_cents, 10);
        assert_eq!(o.customer.as_deref(), Some("ann"));
        let o = NewOrder::from_json(br#"{"product":"x","quantity":1,"amount":0}"#).unwrap();
        assert_eq!(o.amount_cents, 0);
    }

    #[test]
    fn invalid_requests_name_the_field() {
        assert_eq!(field_of(r#"{"product":"lamp"}"#), "quantity");
        assert_eq!(field_of(r#"{"product":"lamp","quantity":0}"#), "quantity");
        assert_eq!(field_of(r#"{"product":"lamp","quantity":-2}"#), "quantity");
        assert_eq!(field_of(r#"{"product":"lamp","quantity":1.5}"#), "quantity");
        assert_eq!(field_of(r#"{"product":"lamp","quantity":"2"}"#), "quantity");
        assert_eq!(
            field_of(r#"{"product":"lamp","quantity":99999999999999999999}"#),
            "quantity"
        );
        assert_eq!(field_of(r#"{"product":"","quantity":1}"#), "product");
        assert_eq!(field_of(r#"{"product":"   ","quantity":1}"#), "product");
        assert_eq!(field_of(r#"{"quantity":1}"#), "product");
        assert_eq!(field_of(r#"{"product":5,"quantity":1}"#), "product");
        assert_eq!(
            field_of(r#"{"product":"lamp","quantity":1,"amount":-1}"#),
            "amount"
        );
        assert_eq!(
            field_of(r#"{"product":"lamp","quantity":1,"amount":1.001}"#),
            "amount"
        );
        assert_eq!(
            field_of(r#"{"product":"lamp","quantity":1,"amount":"3"}"#),
            "amount"
        );
        assert_eq!(
            field_of(r#"{"product":"lamp","quantity":1,"customer":""}"#),
            "customer"
        );
        assert_eq!(
            field_of(r#"{"product":"lamp","quantity":1,"quantitiy":1}"#),
            "quantitiy"
        );
    }

    #[test]
    fn malformed_bodies() {
        for body in ["", "{", "[1,2]", "\"lamp\"", "null", "{\"product\": lamp}"] {
            assert!(
                matches!(
                    NewOrder::from_json(body.as_bytes()),
                    Err(RequestError::Malformed(_))
                ),
                "{body}"
            );
        }
    }
}
