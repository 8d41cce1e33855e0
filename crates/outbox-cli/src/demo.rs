//! `outbox demo`: the seeds' Order system in one process on SQLite files — the order service
//! over real HTTP, a load generator, the relay, an in-process bus that also redelivers, and the
//! delivery and billing consumers with their inboxes — then a check that every effect happened
//! exactly once. The system lives in the `outbox-orders` example crate (`outbox_orders::demo`);
//! this module only connects it to the command line.

pub use outbox_orders::demo::DemoArgs;

/// Run the demo; fails when the final check finds a violation.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    outbox_orders::demo::run(args).await?;
    Ok(())
}
