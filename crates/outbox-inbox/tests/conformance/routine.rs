//! The claim as consumers in other languages run it — PostgreSQL's claim function, MySQL's
//! claim procedure, SQLite's claim statement — written once: each database's test file
//! implements [`ClaimRoutine`] and keeps its own test names, each calling a scenario here.
//!
//! Why: the routines differ in how they are called and what they answer (a boolean, a `fresh`
//! row, a changed-row count), not in what they promise: fresh once, a duplicate after a commit,
//! fresh again after a rollback, a racing call waits for the first transaction, and bad
//! arguments are refused with a SQLSTATE that says why.

use std::time::Duration;

use outbox_inbox::sql::SqlInbox;
use outbox_inbox::{BoxFuture, EventId};

use super::{Backend, Conn, Fixture, setup};

/// A call the claim routine refuses: event id (`None`: SQL NULL), handler, the SQLSTATE and
/// what the message says.
pub type RefusedCall = (Option<String>, String, &'static str, &'static str);

/// How a consumer in another language calls one database's claim routine.
pub trait ClaimRoutine: Backend {
    /// The SQL of a call, the event id and the handler its two parameters.
    fn claim_sql(inbox: &Self::Inbox) -> String;

    /// Run `sql` on `conn` with `id` (the event id as text, as consumers pass it; `None`: SQL
    /// NULL) and `handler`: whether the routine says fresh (apply the effect).
    fn call_claim(
        conn: &mut Conn<Self>,
        sql: String,
        id: Option<String>,
        handler: String,
    ) -> BoxFuture<'_, Result<bool, sqlx::Error>>;

    /// How a consumer spells `id` on the call after the commit; MySQL takes upper case as the
    /// same event.
    fn respell(id: EventId) -> String {
        id.to_string()
    }

    /// The calls the routine refuses (PostgreSQL and MySQL check their arguments).
    fn refused_calls() -> Vec<RefusedCall> {
        Vec::new()
    }
}

/// A routine's answer that is a count, 1 (fresh) or 0 (duplicate), as fresh or not.
pub fn fresh(count: i64) -> bool {
    match count {
        1 => true,
        0 => false,
        other => panic!("the claim answered {other}, not 1 or 0"),
    }
}

/// The claim routine as a consumer in another language runs it: plain SQL in its own
/// transaction. Fresh once; a duplicate once committed; fresh again after a rollback (the
/// rolled-back claim left nothing behind); the Rust claim sees the same row. Returns the
/// fixture for what a database checks beyond that.
pub async fn the_claim_routine_is_plain_sql_any_consumer_can_call<B: ClaimRoutine>() -> Fixture<B> {
    let fx = setup::<B>().await;
    let sql = B::claim_sql(&fx.inbox);
    let id = EventId::new();
    let claim = async |conn: &mut Conn<B>, id: String| -> bool {
        B::call_claim(conn, sql.clone(), Some(id), "billing".to_owned())
            .await
            .unwrap()
    };
    let mut tx = fx.inbox.begin(&fx.pool).await.unwrap();
    assert!(claim(&mut tx, id.to_string()).await);
    tx.rollback().await.unwrap();
    let mut tx = fx.inbox.begin(&fx.pool).await.unwrap();
    assert!(
        claim(&mut tx, id.to_string()).await,
        "a rolled-back claim must not count"
    );
    tx.commit().await.unwrap();
    let mut tx = fx.inbox.begin(&fx.pool).await.unwrap();
    assert!(
        !claim(&mut tx, B::respell(id)).await,
        "a committed claim makes the next one a duplicate"
    );
    tx.commit().await.unwrap();
    assert!(fx.inbox.contains(&fx.pool, id, "billing").await.unwrap());
    fx
}

/// Two consumers in other languages racing on one event: the second call blocks until the
/// first transaction ends, then answers duplicate (it committed).
pub async fn a_racing_claim_routine_call_waits_for_the_first_transaction<B: ClaimRoutine>() {
    let fx = setup::<B>().await;
    let sql = B::claim_sql(&fx.inbox);
    let id = Some(EventId::new().to_string());
    let mut first = fx.inbox.begin(&fx.pool).await.unwrap();
    let fresh = B::call_claim(&mut first, sql.clone(), id.clone(), "billing".to_owned());
    assert!(fresh.await.unwrap());
    let second = {
        let fx = fx.clone();
        tokio::spawn(async move {
            let mut tx = fx.inbox.begin(&fx.pool).await.unwrap();
            let fresh = B::call_claim(&mut tx, sql, id, "billing".to_owned());
            let fresh = fresh.await.unwrap();
            tx.commit().await.unwrap();
            fresh
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished(), "the racing call must wait");
    first.commit().await.unwrap();
    assert!(!second.await.unwrap());
}

/// Each of [`ClaimRoutine::refused_calls`] fails with its SQLSTATE and message.
pub async fn the_claim_routine_refuses_bad_arguments<B: ClaimRoutine>() {
    let fx = setup::<B>().await;
    let sql = B::claim_sql(&fx.inbox);
    let calls = B::refused_calls();
    assert!(!calls.is_empty());
    for (id, handler, code, says) in calls {
        let mut conn = fx.pool.acquire().await.unwrap();
        let err = B::call_claim(&mut conn, sql.clone(), id, handler)
            .await
            .unwrap_err();
        let db = err.as_database_error().unwrap();
        assert_eq!(db.code().as_deref(), Some(code), "{err}");
        assert!(db.message().contains(says), "{err}");
    }
}
