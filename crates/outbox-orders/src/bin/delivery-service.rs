//! `delivery-service`: the delivery consumer of the Order system (see `outbox_orders::consumers`),
//! reading NATS JetStream or Kafka (`--transport`) into its own database with an inbox.

use clap::Parser;
use outbox_orders::consumers::Service;
use outbox_orders::service::{ConsumerArgs, init_logging, run_consumer, shutdown_signal};

#[derive(Parser)]
#[command(
    name = "delivery-service",
    about = "The delivery consumer of the Order system."
)]
struct Cli {
    #[command(flatten)]
    args: ConsumerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_logging();
    let cli = Cli::parse();
    run_consumer(Service::Delivery, cli.args, shutdown_signal()).await?;
    Ok(())
}
