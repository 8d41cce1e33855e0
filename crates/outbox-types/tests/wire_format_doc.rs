//! `docs/wire-format.md` is what consumers in other languages read instead of our source: every
//! header name and content type the routing puts on a message must be in it, so renaming one
//! without the document fails here.

use outbox_types::routing::{
    CloudEvents, CloudEventsMode, PayloadFormat, Routing, Template, header,
};
use outbox_types::{Event, NewEvent};

fn doc() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/wire-format.md");
    std::fs::read_to_string(path).expect("docs/wire-format.md exists")
}

fn event() -> Event {
    NewEvent::from_json("order", "42", "OrderCreated", "{}")
        .unwrap()
        .with_idempotency_key("k")
        .claimed(1)
}

#[test]
fn every_header_and_content_type_the_routing_sends_is_documented() {
    let doc = doc();
    let formats = [
        PayloadFormat::Raw,
        PayloadFormat::CloudEvents(CloudEvents::new("/s")),
        PayloadFormat::CloudEvents(CloudEvents::new("/s").with_mode(CloudEventsMode::Binary)),
        PayloadFormat::Debezium,
    ];
    for format in formats {
        let routing = Routing::new(Template::fixed("t")).with_format(format.clone());
        for (name, _) in routing.headers(&event()) {
            assert!(
                doc.contains(&format!("`{name}`")),
                "header `{name}` ({format:?}) is not in docs/wire-format.md"
            );
        }
        let content_type = routing.content_type();
        assert!(
            doc.contains(&format!("`{content_type}`")),
            "content type `{content_type}` is not in docs/wire-format.md"
        );
    }
    for name in [
        header::EVENT_ID,
        header::EVENT_TYPE,
        header::AGGREGATE_TYPE,
        header::AGGREGATE_ID,
        header::OCCURRED_AT,
        header::IDEMPOTENCY_KEY,
        header::PARTITION,
    ] {
        assert!(
            doc.contains(&format!("`{name}`")),
            "`{name}` is not documented"
        );
    }
}
