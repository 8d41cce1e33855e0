//! What the three binaries do, as library functions: the binaries only parse arguments, set up
//! logging and pass ctrl-c / SIGTERM as the shutdown future; tests call the same functions with
//! a future of their own.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::Error;
use crate::consumers::{Consumer, Service};
use crate::db::Db;
use crate::order::OrderStore;
use crate::transport::TransportArgs;

/// `order-service` arguments.
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "order-service",
    about = "The Order service: POST /orders, POST /orders/{id}/cancel, GET /orders/{id}; every change and its event in one transaction."
)]
pub struct OrderServiceArgs {
    /// postgres://… or sqlite://path (created if missing).
    #[arg(
        long,
        env = "ORDERS_DATABASE_URL",
        default_value = "sqlite://orders.db"
    )]
    pub database_url: String,
    /// PostgreSQL: schema of the `orders` table (created if missing; the connections'
    /// search_path) [default: the user's search_path].
    #[arg(long)]
    pub schema: Option<String>,
    /// PostgreSQL: schema of the outbox table (what `outbox relay` reads as `database.schema`).
    #[arg(long, default_value = "outbox")]
    pub outbox_schema: String,
    /// PostgreSQL: the outbox table.
    #[arg(long, default_value = "events")]
    pub outbox_table: String,
    /// Where to listen.
    #[arg(long, env = "ORDERS_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Database connections.
    #[arg(long, default_value_t = 8)]
    pub max_connections: u32,
}

/// `delivery-service` / `billing-service` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct ConsumerArgs {
    /// The service's own database: postgres://… or sqlite://path.
    #[arg(long, env = "CONSUMER_DATABASE_URL")]
    pub database_url: String,
    /// PostgreSQL: schema of the ledger and inbox tables (created if missing) [default: the
    /// user's search_path].
    #[arg(long)]
    pub schema: Option<String>,
    /// Where the events come from.
    #[command(flatten)]
    pub transport: TransportArgs,
}

/// Open (and migrate) the order service's store as `args` say.
pub async fn open_order_store(args: &OrderServiceArgs) -> Result<OrderStore, Error> {
    let db = Db::connect(
        &args.database_url,
        args.schema.as_deref(),
        args.max_connections,
    )
    .await?;
    let outbox = outbox_postgresql::PgOutbox::with_names(&args.outbox_schema, &args.outbox_table)?;
    let store = OrderStore::new(db, Some(outbox));
    store.migrate().await?;
    Ok(store)
}

/// Run the order service until `shutdown` completes.
pub async fn run_order_service(
    args: OrderServiceArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let store = open_order_store(&args).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Error::Io(format!("cannot listen on {}: {e}", args.listen)))?;
    tracing::info!(listen = %args.listen, database = %outbox_postgresql::redact_url(&args.database_url), "Order service listening.");
    crate::http::serve(listener, store, shutdown)
        .await
        .map_err(|e| Error::Io(format!("HTTP server: {e}")))
}

/// Open (and migrate) a consumer's database as `args` say.
pub async fn open_consumer(service: Service, args: &ConsumerArgs) -> Result<Arc<Consumer>, Error> {
    let db = Db::connect(&args.database_url, args.schema.as_deref(), 4).await?;
    Ok(Arc::new(Consumer::open(service, db).await?))
}

/// Run the delivery or billing service until `shutdown` completes.
pub async fn run_consumer(
    service: Service,
    args: ConsumerArgs,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    let consumer = open_consumer(service, &args).await?;
    crate::transport::consume(consumer, &args.transport, shutdown).await
}

/// The whole of `delivery-service` and `billing-service`: logging, their arguments (the binary's
/// name and help name the service), and [`run_consumer`] until ctrl-c or SIGTERM.
pub async fn consumer_main(service: Service) -> Result<(), Error> {
    use clap::{Args, FromArgMatches};
    init_logging();
    let (name, about) = match service {
        Service::Delivery => (
            "delivery-service",
            "The delivery consumer of the Order system.",
        ),
        Service::Billing => (
            "billing-service",
            "The billing consumer of the Order system.",
        ),
    };
    // `about` after the arguments: their struct's doc comment would replace it otherwise.
    let command = ConsumerArgs::augment_args(clap::Command::new(name)).about(about);
    let args = ConsumerArgs::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit());
    run_consumer(service, args, shutdown_signal()).await
}

/// Completes on ctrl-c or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Human logs on stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
