//! `order-service`: the Order system's HTTP API (see `outbox_orders::http`).

use clap::Parser;
use outbox_orders::service::{OrderServiceArgs, init_logging, run_order_service, shutdown_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_logging();
    let args = OrderServiceArgs::parse();
    run_order_service(args, shutdown_signal()).await?;
    Ok(())
}
