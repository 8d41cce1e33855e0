//! # outbox-store-tests
//!
//! The contract of [`outbox_types::Store`], written once as tests and run by every store crate
//! against its real database: `outbox_store_tests::conformance!(MyHarness::new())` inside a test
//! file expands to one `#[tokio::test]` per property. A store added later passes the same suite
//! as the first one, or it is not done.
//!
//! The writer's side is written once too: a store's test implements [`Writer`] (most of it
//! from [`sqlx_writer!`]) and calls the scenarios of an event existing exactly when its
//! business transaction committed, and of the library refusing a reserved header, from its own
//! `#[tokio::test]` functions.

/// Expand to one test per property of the store contract, using `$harness` (an expression
/// building a [`Harness`]): the relay behaviour tests of [`relay_behaviour!`] and the tests of
/// the store's own statements.
#[macro_export]
macro_rules! conformance {
    ($harness:expr) => {
        $crate::relay_behaviour!($harness);
        $crate::conformance!(@tests $harness;
            claim_returns_due_events_in_order_and_ack_delivers,
            idempotency_key_returns_the_existing_event,
            aggregate_in_flight_blocks_its_later_events_only,
            retry_counts_the_attempt_and_delays_the_event,
            an_unavailable_retry_costs_no_attempt_and_holds_its_aggregate,
            dead_event_blocks_its_aggregate_only_under_block_policy,
            requeue_and_discard_act_on_dead_events_only,
            expired_lease_is_reclaimed_and_stale_writes_are_fenced,
            release_gives_events_back_without_an_attempt,
            purge_deletes_only_old_delivered_events,
            stats_count_every_state,
            last_error_is_truncated,
            concurrent_claims_never_hand_out_an_event_twice,
            pause_holds_only_that_destinations_events,
            held_events_do_not_block_other_destinations,
            a_deferred_destination_keeps_its_place_in_each_aggregate,
            hold_respects_the_dead_letter_policy,
            routes_in_sql_agree_with_resolve,
            destination_stats_count_each_state,
            leases_report_who_holds_what_since_when,
            replay_sends_delivered_events_again,
            purge_dead_deletes_only_old_dead_events,
            purge_never_deletes_an_undelivered_event,
            aggregates_behind_a_long_held_run_are_still_claimed,
            claims_are_bounded_by_payload_bytes,
            oversized_payloads_are_buried_unread_and_hold_their_aggregate,
            claims_are_bounded_by_whole_rows,
            oversized_metadata_is_buried_unread_and_holds_its_aggregate,
            a_backlog_of_one_destination_does_not_starve_the_others,
        );
    };
    (@tests $harness:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::$name(&$harness).await;
            }
        )*
    };
}

/// The relay behaviour tests alone — what a relay does over a source, not what a store's
/// statements do — for a harness whose [`Harness::source`] is not the store itself: WAL mode's
/// stream source runs these, so both sources are held to the same behaviour.
#[macro_export]
macro_rules! relay_behaviour {
    ($harness:expr) => {
        $crate::conformance!(@tests $harness;
            three_relays_deliver_everything_in_order_despite_failures,
            three_relays_deliver_in_order_under_the_block_policy,
            dead_policy_block_holds_the_aggregate_in_a_relay_run,
            relay_gives_up_after_max_attempts,
            shutdown_leaves_nothing_claimed,
            a_hanging_destination_does_not_hold_back_the_others,
            a_batch_waiting_on_a_hanging_destination_gives_its_slot_back,
            a_panicking_sink_costs_attempts_not_a_stuck_claim,
            a_paused_destination_waits_in_a_running_relay_while_others_flow,
            a_requeued_dead_event_goes_out_while_the_relay_runs,
        );
    };
}

/// One `#[tokio::test]` per writer scenario listed, each calling the scenario of the same name
/// (or, written `test => scenario`, of another name) with `$writer` (an expression building a
/// [`Writer`]): the writer's side of the contract, run by each store from its own test file.
#[macro_export]
macro_rules! writer_tests {
    ($writer:expr; $($test:ident $(=> $scenario:ident)?),* $(,)?) => {
        $($crate::writer_tests!(@one $writer; $test $(=> $scenario)?);)*
    };
    (@one $writer:expr; $test:ident) => {
        $crate::writer_tests!(@one $writer; $test => $test);
    };
    (@one $writer:expr; $test:ident => $scenario:ident) => {
        #[tokio::test]
        async fn $test() {
            $crate::$scenario(&$writer).await;
        }
    };
}

mod admin;
mod claim;
mod harness;
mod relay;
mod retention;
mod settle;
mod writer;

pub use admin::*;
pub use claim::*;
pub use harness::*;
pub use relay::*;
pub use retention::*;
pub use settle::*;
pub use writer::*;
