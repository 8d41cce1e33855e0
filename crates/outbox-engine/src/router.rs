//! Several destinations behind one relay.
//!
//! A [`Router`] is a [`Sink`] over named sinks and a [`RouteTable`]: it splits each batch by
//! destination, publishes every part to its own sink at the same time, and puts the outcomes
//! back in input order. The relay above it keeps per-aggregate order as it does for any sink
//! (a batch holds at most one event per aggregate), so routing changes nothing about ordering.
//!
//! Events no route matches are rejected with a reason that names the event and the fix; they
//! become dead and wait for `outbox dead requeue` once a route exists, so a gap in the routing
//! table never loses an event and never blocks other aggregates.
//!
//! ```
//! use std::sync::Arc;
//! use outbox_types::route::{Pattern, RouteRule, RouteTable};
//! use outbox_types::Sink;
//! use outbox_engine::router::Router;
//! # struct NullSink;
//! # #[async_trait::async_trait]
//! # impl Sink for NullSink {
//! #     fn name(&self) -> &str { "null" }
//! #     async fn publish(&self, e: &[outbox_types::Event]) -> Vec<outbox_types::Outcome> {
//! #         vec![outbox_types::Outcome::Delivered; e.len()]
//! #     }
//! # }
//! let routes = RouteTable::new(
//!     ["orders", "audit"],
//!     vec![RouteRule::to("audit").event_type(Pattern::parse("Audit*")), RouteRule::to("orders")],
//! )
//! .unwrap();
//! let orders: Arc<dyn Sink> = Arc::new(NullSink);
//! let audit: Arc<dyn Sink> = Arc::new(NullSink);
//! let router = Router::new(routes, vec![("orders".into(), orders), ("audit".into(), audit)]).unwrap();
//! assert_eq!(router.name(), "router");
//! ```

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use outbox_types::route::{RouteError, RouteTable};
use outbox_types::{Event, Outcome, Sink, SinkError};

/// A sink that dispatches each event to the destination its route names.
pub struct Router {
    routes: Arc<RouteTable>,
    /// In the order of `routes.destinations()`.
    sinks: Vec<Arc<dyn Sink>>,
}

impl Router {
    /// A router over `sinks` (name, sink). Every destination of `routes` needs exactly one
    /// sink, and every sink a destination.
    pub fn new(
        routes: RouteTable,
        sinks: Vec<(String, Arc<dyn Sink>)>,
    ) -> Result<Self, RouteError> {
        let mut ordered = Vec::with_capacity(routes.destinations().len());
        for name in routes.destinations() {
            let sink = sinks
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s.clone())
                .ok_or_else(|| RouteError(format!("destination `{name}` has no sink")))?;
            ordered.push(sink);
        }
        if let Some((extra, _)) = sinks.iter().find(|(n, _)| !routes.contains(n)) {
            return Err(RouteError(format!(
                "sink `{extra}` is not a destination of the route table"
            )));
        }
        Ok(Router {
            routes: Arc::new(routes),
            sinks: ordered,
        })
    }

    /// The route table (the relay uses it to hold paused destinations and to label metrics).
    pub fn routes(&self) -> Arc<RouteTable> {
        self.routes.clone()
    }

    /// The sink of destination `name`.
    pub fn sink(&self, name: &str) -> Option<&Arc<dyn Sink>> {
        let i = self.routes.destinations().iter().position(|d| d == name)?;
        self.sinks.get(i)
    }
}

/// Why an event has no destination, and what to do about it.
pub fn unroutable_reason(event: &Event) -> String {
    format!(
        "no route matches this event (event_type `{}`, aggregate_type `{}`, destination column {}): \
         add a [[routes]] rule that matches it (or set the destination column to a configured destination), \
         then run `outbox dead requeue {}`",
        event.event_type,
        event.aggregate_type,
        event
            .destination
            .as_deref()
            .map(|d| format!("`{d}`"))
            .unwrap_or_else(|| "empty".into()),
        event.id
    )
}

#[async_trait]
impl Sink for Router {
    fn name(&self) -> &str {
        "router"
    }

    async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
        let names = self.routes.destinations();
        let mut parts: Vec<(Vec<usize>, Vec<Event>)> = vec![(Vec::new(), Vec::new()); names.len()];
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        for (i, event) in events.iter().enumerate() {
            let Some(target) = self.routes.resolve_event(event) else {
                outcomes[i] = Some(Outcome::reject(unroutable_reason(event)));
                continue;
            };
            let Some(slot) = names.iter().position(|n| n == target) else {
                outcomes[i] = Some(Outcome::reject(unroutable_reason(event)));
                continue;
            };
            let mut event = event.clone();
            // A destination column that names the destination selected it; it is not a topic.
            if event.destination.as_deref() == Some(target) {
                event.destination = None;
            }
            parts[slot].0.push(i);
            parts[slot].1.push(event);
        }
        let calls = parts
            .iter()
            .enumerate()
            .filter(|(_, (_, batch))| !batch.is_empty())
            .map(|(slot, (_, batch))| {
                let sink = self.sinks[slot].clone();
                let name = names[slot].clone();
                async move {
                    let started = Instant::now();
                    let mut result = sink.publish(batch).await;
                    metrics::histogram!("outbox_publish_duration_seconds", "destination" => name.clone())
                        .record(started.elapsed().as_secs_f64());
                    if result.len() != batch.len() {
                        let reason = format!(
                            "sink of destination `{name}` returned {} outcomes for {} events (a sink bug); retrying all",
                            result.len(),
                            batch.len()
                        );
                        result = vec![Outcome::retry(reason); batch.len()];
                    }
                    (slot, result)
                }
            });
        for (slot, result) in futures_join_all(calls).await {
            for (&i, outcome) in parts[slot].0.iter().zip(result) {
                outcomes[i] = Some(outcome);
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry("no outcome recorded (router bug)")))
            .collect()
    }

    async fn check(&self) -> Result<(), SinkError> {
        let mut problems = Vec::new();
        for (name, sink) in self.routes.destinations().iter().zip(&self.sinks) {
            if let Err(e) = sink.check().await {
                problems.push(format!("destination `{name}`: {e}"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(SinkError::Unavailable(problems.join("; ")))
        }
    }
}

/// Await every future concurrently (a tiny `join_all`, to keep this crate's dependencies few).
async fn futures_join_all<F, T>(futures: impl Iterator<Item = F>) -> Vec<T>
where
    F: std::future::Future<Output = T>,
{
    let mut set: Vec<std::pin::Pin<Box<F>>> = futures.map(Box::pin).collect();
    let mut results: Vec<Option<T>> = (0..set.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, fut) in set.iter_mut().enumerate() {
            if results[i].is_none() {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => results[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    results.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_types::NewEvent;
    use outbox_types::route::{Pattern, RouteRule};
    use std::sync::Mutex;

    struct Recording {
        name: &'static str,
        seen: Mutex<Vec<Event>>,
        outcome: Outcome,
    }

    #[async_trait]
    impl Sink for Recording {
        fn name(&self) -> &str {
            self.name
        }
        async fn publish(&self, events: &[Event]) -> Vec<Outcome> {
            self.seen.lock().unwrap().extend(events.iter().cloned());
            vec![self.outcome.clone(); events.len()]
        }
    }

    fn event(event_type: &str, destination: Option<&str>) -> Event {
        let event = NewEvent::from_json("order", "1", event_type, "{}").unwrap();
        match destination {
            Some(d) => event.with_destination(d),
            None => event,
        }
        .claimed(1)
    }

    #[tokio::test]
    async fn events_go_to_their_destination_and_outcomes_keep_input_order() {
        let a = Arc::new(Recording {
            name: "a",
            seen: Mutex::default(),
            outcome: Outcome::Delivered,
        });
        let b = Arc::new(Recording {
            name: "b",
            seen: Mutex::default(),
            outcome: Outcome::retry("down"),
        });
        let routes = RouteTable::new(
            ["a", "b"],
            vec![RouteRule::to("b").event_type(Pattern::parse("B*"))],
        )
        .unwrap();
        let router = Router::new(
            routes,
            vec![
                ("a".into(), a.clone() as Arc<dyn Sink>),
                ("b".into(), b.clone() as Arc<dyn Sink>),
            ],
        )
        .unwrap();
        let events = vec![
            event("Bee", None),
            event("X", Some("a")),
            event("X", None),
            event("Bee", Some("topic.b")),
        ];
        let outcomes = router.publish(&events).await;
        assert_eq!(outcomes[0], Outcome::retry("down"));
        assert_eq!(outcomes[1], Outcome::Delivered);
        assert!(
            matches!(&outcomes[2], Outcome::Reject { reason } if reason.contains("no route matches") && reason.contains("event_type `X`")),
            "{:?}",
            outcomes[2]
        );
        assert_eq!(outcomes[3], Outcome::retry("down"));
        let seen_a = a.seen.lock().unwrap();
        assert_eq!(seen_a.len(), 1);
        assert_eq!(seen_a[0].destination, None, "the naming column is consumed");
        let seen_b = b.seen.lock().unwrap();
        assert_eq!(seen_b.len(), 2);
        assert_eq!(
            seen_b[1].destination.as_deref(),
            Some("topic.b"),
            "a topic hint passes through"
        );
    }

    #[test]
    fn every_destination_needs_a_sink() {
        let routes = RouteTable::new(["a", "b"], vec![]).unwrap();
        let sink = Arc::new(Recording {
            name: "a",
            seen: Mutex::default(),
            outcome: Outcome::Delivered,
        }) as Arc<dyn Sink>;
        let err = Router::new(routes.clone(), vec![("a".into(), sink.clone())])
            .err()
            .unwrap();
        assert!(err.0.contains("`b` has no sink"), "{err}");
        let err = Router::new(
            routes,
            vec![
                ("a".into(), sink.clone()),
                ("b".into(), sink.clone()),
                ("c".into(), sink),
            ],
        )
        .err()
        .unwrap();
        assert!(err.0.contains("`c`"), "{err}");
    }
}
