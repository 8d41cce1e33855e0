//! The claim (see the crate docs for its design): the named claim lock (`GET_LOCK`), a plain
//! read of the due candidates, then the rows locked and leased in one short transaction, sorted
//! by the core's [`ClaimSort`] into deliverable and buried rows.

use crate::MySqlStore;
use crate::decode::decode_event;
use crate::error::map_sqlx;
use crate::session::Session;
use crate::sql::{json_text, micros};
use outbox_types::sql_store::{bytes, count};
use outbox_types::{
    AggregateKey, Claim, ClaimRequest, ClaimSort, DeadLetterPolicy, Lease, RowBytes, SortedClaim,
    StoreError,
};
use sqlx::mysql::MySqlRow;
use sqlx::{AssertSqlSafe, Row};
use std::collections::HashSet;
use uuid::Uuid;

/// How long a claim waits for the claim lock before it claims without it (see the crate docs).
pub const CLAIM_LOCK_WAIT_SECONDS: u32 = 5;

/// The longest lease owner stored; the [`Lease`] handed back keeps the whole name.
const MAX_OWNER_CHARS: usize = 255;

pub(crate) async fn claim(store: &MySqlStore, request: &ClaimRequest) -> Result<Claim, StoreError> {
    let token = Uuid::now_v7();
    let lease = Lease {
        owner: request.owner.clone(),
        token,
    };
    if request.limit == 0 {
        return Ok(Claim {
            lease,
            events: Vec::new(),
            buried: 0,
        });
    }
    let sql = store.sql();
    let (mut session, serialized) = Session::open_with_lock(
        &store.pool,
        &sql.claim_lock,
        &sql.claim_unlock,
        CLAIM_LOCK_WAIT_SECONDS,
    )
    .await?;
    if !serialized {
        tracing::warn!(
            table = store.outbox.table(),
            wait_s = CLAIM_LOCK_WAIT_SECONDS,
            "Outbox claim lock not granted in time; claiming without it (still safe, less efficient)."
        );
    }
    match store.claim_rows(&mut session, request, token).await {
        Ok(sorted) => {
            // The claim is committed: hand it out even if the release fails. The session then
            // still counts as holding the lock and is closed on drop, which releases it.
            if let Err(error) = session.release_lock(&sql.claim_unlock).await {
                tracing::warn!(%error, "Releasing the outbox claim lock failed; closing the connection.");
            }
            sorted.into_claim(store, lease).await
        }
        Err(error) => {
            session.abandon(&sql.claim_unlock).await;
            Err(error)
        }
    }
}

impl MySqlStore {
    /// Steps 2 to 4 of a claim (see the crate docs), on a session that may hold the claim lock.
    pub(crate) async fn claim_rows(
        &self,
        session: &mut Session,
        request: &ClaimRequest,
        token: Uuid,
    ) -> Result<SortedClaim, StoreError> {
        let sql = self.sql();
        let block = request.dead_letter == DeadLetterPolicy::Block;
        let limit = i64::from(request.limit);
        // A plain read outside any transaction: what is due now, unblocked, in seq order.
        let hold = request
            .hold
            .as_deref()
            .filter(|h| !h.paused.is_empty() || !h.deferred.is_empty());
        let candidates = match hold {
            None => {
                sqlx::query(AssertSqlSafe(sql.claim_candidates.as_str()))
                    .bind(bytes(request.max_metadata_bytes))
                    .bind(block)
                    .bind(limit)
                    .bind(block)
                    .bind(limit)
                    .bind(limit)
                    .fetch_all(session.conn())
                    .await
            }
            Some(hold) => {
                let built = sql.held_claim_candidates(
                    &hold.routes,
                    &hold.paused,
                    &hold.deferred,
                    block,
                    limit,
                    bytes(request.max_metadata_bytes),
                );
                built.query().fetch_all(session.conn()).await
            }
        }
        .map_err(map_sqlx)?;
        if candidates.is_empty() {
            return Ok(SortedClaim::default());
        }
        let mut wanted = Vec::with_capacity(candidates.len());
        // The byte budget: candidates in seq order while the rows before them (payload and
        // every other column) add up to less than `max_batch_bytes` (the first always). What it
        // leaves out comes after everything it keeps. A row over `max_payload_bytes` or
        // `max_metadata_bytes` counts as nothing: it is locked without its columns and buried.
        let mut running: u64 = 0;
        for row in &candidates {
            let payload: Option<i64> = row.try_get("payload_bytes").map_err(map_sqlx)?;
            let metadata: Option<i64> = row.try_get("metadata_bytes").map_err(map_sqlx)?;
            let size = RowBytes {
                payload: count(payload.unwrap_or(0)),
                metadata: count(metadata.unwrap_or(0)),
            }
            .batch_bytes(request);
            if !wanted.is_empty() && running >= request.max_batch_bytes {
                break;
            }
            running = running.saturating_add(size);
            let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
            wanted.push((seq, aggregate_of(row)?));
        }
        let seqs: Vec<i64> = wanted.iter().map(|(seq, _)| *seq).collect();

        session.begin().await?;
        let locked = sqlx::query(AssertSqlSafe(sql.claim_lock_rows.as_str()))
            .bind(bytes(request.max_payload_bytes))
            .bind(bytes(request.max_metadata_bytes))
            .bind(json_text(&seqs)?)
            .fetch_all(session.conn())
            .await
            .map_err(map_sqlx)?;
        let locked_seqs = locked
            .iter()
            .map(|row| row.try_get::<i64, _>("seq").map_err(map_sqlx))
            .collect::<Result<HashSet<i64>, _>>()?;
        let keep = keep_in_order(&wanted, locked_seqs);
        if keep.is_empty() {
            session.rollback().await?;
            return Ok(SortedClaim::default());
        }
        // Rows that cannot be delivered are claimed with the rest and buried right after, so one
        // bad row neither fails the claim nor lets its aggregate's later events overtake it.
        let mut sort = ClaimSort::new(request);
        let mut kept = Vec::with_capacity(keep.len());
        for row in &locked {
            let seq: i64 = row.try_get("seq").map_err(map_sqlx)?;
            if !keep.contains(&seq) {
                continue;
            }
            kept.push(seq);
            let payload_bytes: Option<i64> = row.try_get("payload_bytes").map_err(map_sqlx)?;
            let metadata_bytes: Option<i64> = row.try_get("metadata_bytes").map_err(map_sqlx)?;
            let aggregate = || aggregate_of(row);
            outbox_types::sort_claimed_row!(
                sort,
                seq,
                payload_bytes,
                metadata_bytes,
                aggregate,
                || decode_event(row)
            );
        }
        let owner: String = request.owner.chars().take(MAX_OWNER_CHARS).collect();
        let done = sqlx::query(AssertSqlSafe(sql.claim_update.as_str()))
            .bind(json_text(&kept)?)
            .bind(owner)
            .bind(token.to_string())
            .bind(micros(request.lease))
            .execute(session.conn())
            .await
            .map_err(map_sqlx)?;
        if done.rows_affected() != kept.len() as u64 {
            return Err(StoreError::Database(format!(
                "claim marked {} of the {} rows it had locked",
                done.rows_affected(),
                kept.len()
            )));
        }
        session.commit().await?;
        Ok(sort.finish())
    }
}

/// The aggregate key of a claim row, `None` when the statement left out a key over the
/// metadata limit.
fn aggregate_of(row: &MySqlRow) -> Result<Option<AggregateKey>, StoreError> {
    Ok(AggregateKey::from_columns(
        row.try_get("aggregate_type").map_err(map_sqlx)?,
        row.try_get("aggregate_id").map_err(map_sqlx)?,
    ))
}

/// Which of the `wanted` candidates (in seq order) a claim may take, given the seqs it could lock
/// and found still due: a candidate it could not take holds back every later candidate of its
/// aggregate, which must not overtake it. Candidates whose key was too large to send (`None`)
/// count as one aggregate: each of them is buried unread, and one held back holds back the
/// others until the next claim.
fn keep_in_order(wanted: &[(i64, Option<AggregateKey>)], locked: HashSet<i64>) -> HashSet<i64> {
    let mut held_back: HashSet<&Option<AggregateKey>> = HashSet::new();
    let mut keep = HashSet::with_capacity(locked.len());
    for (seq, aggregate) in wanted {
        if held_back.contains(aggregate) {
            continue;
        }
        if locked.contains(seq) {
            keep.insert(*seq);
        } else {
            held_back.insert(aggregate);
        }
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::tests::{test_pool, unique_table};
    use crate::{MySqlOutbox, MySqlStore};
    use outbox_testkit::numbered;
    use outbox_types::{BuryEvent, DeadFilter, Store};
    use std::time::Duration;

    fn agg(id: &str) -> Option<AggregateKey> {
        Some(AggregateKey {
            aggregate_type: "t".into(),
            aggregate_id: id.into(),
        })
    }

    #[test]
    fn a_candidate_not_taken_holds_back_its_aggregate_only() {
        let wanted = vec![
            (1, agg("a")),
            (2, agg("b")),
            (3, agg("a")),
            (4, agg("b")),
            (5, agg("c")),
        ];
        // a/1 was locked by someone else: a/3 must wait; b and c go on.
        let keep = keep_in_order(&wanted, [2, 3, 4, 5].into_iter().collect());
        let mut keep: Vec<i64> = keep.into_iter().collect();
        keep.sort();
        assert_eq!(keep, vec![2, 4, 5]);
        // b/4 lost only itself: nothing after it in b.
        let keep = keep_in_order(&wanted, [1, 2, 3, 5].into_iter().collect());
        assert_eq!(keep.len(), 4);
    }

    /// A claim's statement reads the clock (`UTC_TIMESTAMP()`) when it starts and its rows a
    /// little later. An event requeued in between must still be due to it: a pending event with
    /// no attempts holds nothing back, so were it not due, its aggregate's later events would be
    /// claimed ahead of it (CI once saw `p` delivered as 0, 2, 3, 1). `SET timestamp` pins the
    /// claiming session's clock to a moment before the requeue.
    #[tokio::test]
    async fn a_claim_whose_clock_was_read_before_a_requeue_takes_the_requeued_event_first() {
        let pool = test_pool(3).await;
        let outbox = MySqlOutbox::with_table(&unique_table("requeue")).unwrap();
        outbox.migrate(&pool).await.unwrap();
        let store = MySqlStore::new(pool.clone(), outbox);
        let events = [numbered("p", 1), numbered("p", 2)];
        let enqueued = store.outbox().enqueue_batch(&pool, &events).await.unwrap();
        let request = |limit| {
            ClaimRequest::new(
                "relay",
                limit,
                Duration::from_secs(30),
                DeadLetterPolicy::Block,
            )
        };
        let first = store.claim(&request(1)).await.unwrap();
        let buried = BuryEvent {
            seq: first.events[0].seq,
            error: "refused".into(),
        };
        store.bury(&first.lease, &[buried]).await.unwrap();
        let before: String = sqlx::query_scalar("SELECT CAST(UNIX_TIMESTAMP(NOW(6)) AS CHAR)")
            .fetch_one(&pool)
            .await
            .unwrap();
        let requeued = store
            .requeue_dead(&DeadFilter::Ids(vec![enqueued[0].id]))
            .await
            .unwrap();
        assert_eq!(requeued, 1);

        let mut session = Session::open(&pool).await.unwrap();
        sqlx::query(AssertSqlSafe(format!("SET timestamp = {before}")))
            .execute(session.conn())
            .await
            .unwrap();
        let sorted = store
            .claim_rows(&mut session, &request(10), Uuid::now_v7())
            .await
            .unwrap();
        sqlx::query("SET timestamp = DEFAULT")
            .execute(session.conn())
            .await
            .unwrap();
        let ids: Vec<_> = sorted.events.iter().map(|e| e.id).collect();
        assert_eq!(
            ids.first(),
            Some(&enqueued[0].id),
            "the requeued event goes first: {ids:?}"
        );
    }
}
