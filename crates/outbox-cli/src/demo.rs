//! `outbox demo`: the seeds' Order system in one process on SQLite files — the order service
//! over real HTTP, a load generator, the relay, an in-process bus that also redelivers, and the
//! delivery and billing consumers with their inboxes — then a check that every effect happened
//! exactly once. The system lives in the `outbox-orders` crate (`outbox_orders::demo`); this
//! module only connects it to the command line. A build without the `demo` feature keeps the
//! command, which then says how to get a build that has it.

#[cfg(feature = "demo")]
pub use outbox_orders::demo::DemoArgs;

/// Run the demo; fails when the final check finds a violation.
#[cfg(feature = "demo")]
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    outbox_orders::demo::run(args).await?;
    Ok(())
}

/// No settings: this build has no demo.
#[cfg(not(feature = "demo"))]
#[derive(clap::Args)]
pub struct DemoArgs {}

/// Say that this build has no demo.
#[cfg(not(feature = "demo"))]
pub async fn run(_: DemoArgs) -> anyhow::Result<()> {
    Err(crate::config::ConfigError(
        crate::config::NotInBuild {
            what: "`outbox demo`".into(),
            feature: "demo",
        }
        .to_string(),
    )
    .into())
}
