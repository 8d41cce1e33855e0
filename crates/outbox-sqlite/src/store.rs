//! The [`Store`] implementation: one line per operation, each delegating to the module of its
//! concern (a trait impl cannot be split across files).

use crate::SqliteStore;
use crate::{admin, claim, retention, settle};
use async_trait::async_trait;
use outbox_types::Store;
use outbox_types::route::RouteTable;
use outbox_types::{
    BuryEvent, Claim, ClaimRequest, DeadFilter, DestinationStats, EventId, EventRecord, Lease,
    LeaseHolder, OutboxStats, PausedDestination, ReplayFilter, ReplayStep, RetryEvent, StoreError,
};
use std::time::Duration;

#[async_trait]
impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, StoreError> {
        claim::claim(self, request).await
    }

    async fn ack(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        settle::ack(self, lease, seqs).await
    }

    async fn retry(&self, lease: &Lease, events: &[RetryEvent]) -> Result<u64, StoreError> {
        settle::retry(self, lease, events).await
    }

    async fn bury(&self, lease: &Lease, events: &[BuryEvent]) -> Result<u64, StoreError> {
        settle::bury(self, lease, events).await
    }

    async fn release(&self, lease: &Lease, seqs: &[i64]) -> Result<u64, StoreError> {
        settle::release(self, lease, seqs).await
    }

    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        admin::stats(self).await
    }

    async fn get(&self, id: EventId) -> Result<Option<EventRecord>, StoreError> {
        admin::get(self, id).await
    }

    async fn list_dead(
        &self,
        after_seq: Option<i64>,
        limit: u32,
    ) -> Result<Vec<EventRecord>, StoreError> {
        admin::list_dead(self, after_seq, limit).await
    }

    async fn requeue_dead(&self, filter: &DeadFilter) -> Result<u64, StoreError> {
        admin::requeue_dead(self, filter).await
    }

    async fn discard_dead(&self, filter: &DeadFilter) -> Result<u64, StoreError> {
        admin::discard_dead(self, filter).await
    }

    async fn purge_delivered(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        retention::purge_delivered(self, older_than, limit).await
    }

    async fn destination_stats(
        &self,
        routes: &RouteTable,
    ) -> Result<Vec<DestinationStats>, StoreError> {
        admin::destination_stats(self, routes).await
    }

    async fn leases(&self) -> Result<Vec<LeaseHolder>, StoreError> {
        admin::leases(self).await
    }

    async fn pause(&self, destination: &str, by: &str) -> Result<bool, StoreError> {
        admin::pause(self, destination, by).await
    }

    async fn resume(&self, destination: &str) -> Result<bool, StoreError> {
        admin::resume(self, destination).await
    }

    async fn paused(&self) -> Result<Vec<PausedDestination>, StoreError> {
        admin::paused(self).await
    }

    async fn replay(
        &self,
        filter: &ReplayFilter,
        routes: &RouteTable,
        after_seq: Option<i64>,
        limit: u32,
    ) -> Result<ReplayStep, StoreError> {
        admin::replay(self, filter, routes, after_seq, limit).await
    }

    async fn purge_dead(&self, older_than: Duration, limit: u32) -> Result<u64, StoreError> {
        retention::purge_dead(self, older_than, limit).await
    }

    async fn check(&self) -> Result<(), StoreError> {
        admin::check(self).await
    }
}
