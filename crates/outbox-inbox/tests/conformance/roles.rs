//! A shared inbox among consumers that log in as different database users (issue 41, item 15):
//! one consumer's writes, made with the grants docs/inbox.md gives it, cannot claim an event for
//! another consumer's handler, and claims written before the upgrade that keyed claims by their
//! writer still count for everyone. PostgreSQL and MySQL implement [`SharedInbox`]; SQLite has
//! no users (whoever can write the file controls every row).

use std::future::Future;

use outbox_inbox::sql::SqlInbox;
use outbox_inbox::{EventId, InboxClaim};
use sqlx::Pool;

use super::{Backend, Conn, Db, execute, setup};

/// What a database needs for the scenarios: logins of their own with a consumer's grants.
pub trait SharedInbox: Backend {
    /// Create the login `name` with exactly the grants docs/inbox.md gives a consumer of
    /// `inbox`, and a pool logged in as it.
    fn consumer(inbox: &Self::Inbox, name: &str) -> impl Future<Output = Pool<Db<Self>>> + Send;

    /// SQL (run as the administrator) dropping the login `name` and what it owns.
    fn drop_consumer(name: &str) -> String;

    /// SQL that takes a migrated inbox back to schema version 2, before claims recorded their
    /// writer.
    fn downgrade_to_version_2(inbox: &Self::Inbox) -> String;

    /// An `INSERT` of `(id, handler)` naming `writer` as the claim's writer, as a consumer with
    /// `INSERT` on the inbox could write it.
    fn forged_insert(inbox: &Self::Inbox, id: EventId, handler: &str, writer: &str) -> String {
        format!(
            "INSERT INTO {} (event_id, handler, claimed_by) VALUES ('{id}', '{handler}', '{writer}')",
            Self::beside(inbox, "")
        )
    }
}

/// `who` claims `id` for `handler` through the Rust claim (the claim routine), committed.
async fn claim_as<B: SharedInbox>(
    inbox: &B::Inbox,
    who: &Pool<Db<B>>,
    id: EventId,
    handler: &str,
) -> InboxClaim {
    let mut tx = inbox.begin(who).await.unwrap();
    let claim = SqlInbox::claim(inbox, &mut tx, id, handler).await.unwrap();
    tx.commit().await.unwrap();
    claim
}

/// Shipping's consumer, with the grants a consumer has, writes billing's claims first — through
/// the claim routine, and with a plain `INSERT` that names billing's user as the writer — and
/// billing's claims are fresh all the same, once: a claim row belongs to the user that wrote
/// it. Before, the first row of `(event_id, 'billing')` was billing's claim, whoever wrote it,
/// and billing skipped the effect.
pub async fn a_consumer_cannot_claim_an_event_for_another_consumers_handler<B: SharedInbox>() {
    let fx = setup::<B>().await;
    let billing_name = outbox_testkit::unique("in_billing");
    let shipping_name = outbox_testkit::unique("in_shipping");
    let billing = B::consumer(&fx.inbox, &billing_name).await;
    let shipping = B::consumer(&fx.inbox, &shipping_name).await;
    let (x, y) = (EventId::new(), EventId::new());

    // Through the claim routine.
    assert_eq!(
        claim_as::<B>(&fx.inbox, &shipping, x, "billing").await,
        InboxClaim::Fresh
    );
    assert_eq!(
        claim_as::<B>(&fx.inbox, &billing, x, "billing").await,
        InboxClaim::Fresh,
        "another consumer's row is not billing's claim"
    );
    // A plain INSERT naming billing's user as the writer.
    let mut conn = shipping.acquire().await.unwrap();
    let c: &mut Conn<B> = &mut conn;
    B::execute(c, B::forged_insert(&fx.inbox, y, "billing", &billing_name))
        .await
        .unwrap();
    drop(conn);
    assert_eq!(
        claim_as::<B>(&fx.inbox, &billing, y, "billing").await,
        InboxClaim::Fresh,
        "a forged writer is not billing"
    );
    for id in [x, y] {
        assert_eq!(
            claim_as::<B>(&fx.inbox, &billing, id, "billing").await,
            InboxClaim::Duplicate,
            "billing's own claim deduplicates"
        );
    }
    assert_eq!(
        claim_as::<B>(&fx.inbox, &shipping, x, "billing").await,
        InboxClaim::Duplicate,
        "and shipping's own row is shipping's"
    );
    billing.close().await;
    shipping.close().await;
    for name in [&billing_name, &shipping_name] {
        execute(&fx, B::drop_consumer(name)).await;
    }
}

/// Claims written before the upgrade (schema version 2) have no writer; they count for every
/// consumer, so the upgrade processes nothing a second time, while new events are claimed per
/// consumer as above.
pub async fn claims_from_before_the_upgrade_count_for_every_consumer<B: SharedInbox>() {
    let fx = setup::<B>().await;
    execute(&fx, B::downgrade_to_version_2(&fx.inbox)).await;
    let old = EventId::new();
    assert_eq!(
        claim_as::<B>(&fx.inbox, &fx.pool, old, "billing").await,
        InboxClaim::Fresh
    );
    let report = fx.inbox.migrate(&fx.pool).await.unwrap();
    assert_eq!(report.applied, vec![3]);
    let name = outbox_testkit::unique("in_billing");
    let billing = B::consumer(&fx.inbox, &name).await;
    assert_eq!(
        claim_as::<B>(&fx.inbox, &billing, old, "billing").await,
        InboxClaim::Duplicate,
        "processed before the upgrade"
    );
    let new = EventId::new();
    assert_eq!(
        claim_as::<B>(&fx.inbox, &billing, new, "billing").await,
        InboxClaim::Fresh
    );
    billing.close().await;
    execute(&fx, B::drop_consumer(&name)).await;
}
