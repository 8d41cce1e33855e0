//! `delivery-service`: the delivery consumer of the Order system (see `outbox_orders::consumers`),
//! reading NATS JetStream or Kafka (`--transport`) into its own database with an inbox.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Ok(outbox_orders::service::consumer_main(outbox_orders::consumers::Service::Delivery).await?)
}
