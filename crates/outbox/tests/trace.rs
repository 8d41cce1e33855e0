//! The trace context of the writer's current span ends up on the event, in W3C form.
#![cfg(feature = "opentelemetry")]

use opentelemetry::trace::TracerProvider as _;
use tracing_subscriber::layer::SubscriberExt;

#[test]
fn the_current_span_gives_a_valid_traceparent() {
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let tracer = provider.tracer("outbox-test");
    let subscriber =
        tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(tracer));
    tracing::subscriber::with_default(subscriber, || {
        assert_eq!(
            outbox::trace::current_traceparent(),
            None,
            "no span, no context"
        );
        let span = tracing::info_span!("place_order");
        let _entered = span.enter();
        let tp = outbox::trace::current_traceparent().expect("a recorded span has a context");
        assert!(outbox::is_valid_traceparent(&tp), "{tp}");
        let event = outbox::NewEvent::new("order", "1", "OrderCreated", &1)
            .unwrap()
            .with_traceparent(&tp, None)
            .unwrap();
        assert_eq!(event.headers()["traceparent"], tp);
    });
}
