"""Read what the relay published with each broker's stock Python client and check it, field by
field, against docs/wire-format.md.

Run by crates/outbox-cli/tests/wire_format.rs:

    check.py DOC TAG

1. Prepares what must exist before the relay publishes (RabbitMQ queues bound to the exchange,
   the NATS stream, an HTTP receiver) and prints `ready <http port>`.
2. Waits for one line on stdin: the path of a JSON file naming the variants (destination name,
   type, format, CloudEvents settings) and the events the test enqueued for each.
3. Reads every destination and checks every message. Exits 0 when all match; otherwise prints
   each mismatch and exits 1.

The document and this checker share the tables: for each table the checker reads the first
column of the document's rows and holds one check per row. A row without a check, or a check
without a row, fails the run, so the document cannot describe a field this run does not look at,
and the run cannot look at a field the document does not describe. A row whose property a
consumer cannot observe on one message (a size limit, a partitioner) maps to `NOT_OBSERVABLE`
with the reason.
"""

import base64
import datetime as dt
import http.server
import json
import os
import re
import sys
import threading
import time

import nats
import pika
import redis
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.formats.json import JSONFormat
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_CREATE_TIME
from standardwebhooks.webhooks import Webhook

NOT_OBSERVABLE = object()
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672/%2F"
NATS = "nats://127.0.0.1:4222"
REDIS = "redis://127.0.0.1:6379"
KAFKA = os.environ.get("WIRE_KAFKA", "127.0.0.1:19092")

failures = []


def fail(where, what):
    failures.append(f"{where}: {what}")


def received_events(where0, events, received, missing):
    """Each event with where it is reported and what arrived for it (`received` by event id);
    an event that never arrived fails, saying `missing`, and is skipped."""
    for event in events:
        where = f"{where0} event {event['id']}"
        if event["id"] not in received:
            fail(where, missing)
            continue
        yield event, where, received[event["id"]]


def expect(where, name, got, want):
    if got != want:
        fail(where, f"{name} is {got!r}, the document says {want!r}")


# --- the document -------------------------------------------------------------------------------


def section(doc, heading):
    """The text of the `## heading` section (up to the next `## `)."""
    start = doc.index(f"## {heading}")
    end = doc.find("\n## ", start + 3)
    return doc[start:] if end < 0 else doc[start:end]


def table_after(text, marker):
    """First-column names of the first Markdown table after `marker` (backticks removed)."""
    start = text.index(marker)
    rows = []
    in_table = False
    for line in text[start:].splitlines():
        if line.startswith("|"):
            in_table = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if set(cells[0]) <= set("-: ") or cells[0] in ("part", "header", "field", "attribute",
                                                            "header (lower case on the wire)"):
                continue
            rows.append(cells[0].replace("`", ""))
        elif in_table:
            break
    if not rows:
        raise SystemExit(f"docs/wire-format.md: no table after {marker!r}")
    return rows


def same_rows(where, doc_rows, checks):
    ok = True
    for row in doc_rows:
        if row not in checks:
            fail(where, f"the document has the row {row!r}, which this checker does not check")
            ok = False
    for row in checks:
        if row not in doc_rows:
            fail(where, f"the checker checks {row!r}, which the document's table lacks")
            ok = False
    return ok


def run_checks(where, doc_rows, checks, *args):
    if not same_rows(where, doc_rows, checks):
        return
    for row in doc_rows:
        check = checks[row]
        if check is NOT_OBSERVABLE:
            continue
        try:
            check(f"{where} [{row}]", *args)
        except Exception as e:  # a check that crashes is a mismatch, named
            fail(f"{where} [{row}]", f"{type(e).__name__}: {e}")


# --- expectations shared by every destination ----------------------------------------------------


def parse_time(text):
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def routing_header_checks(event):
    """The routing headers' table: one check per row, over a dict of the message's headers."""

    def value(name, want):
        def check(where, headers):
            expect(where, name, headers.get(name), want)

        return check

    def occurred(where, headers):
        got = headers.get("outbox-occurred-at")
        if got is None or parse_time(got) != parse_time(event["occurred_at"]):
            fail(where, f"outbox-occurred-at is {got!r}, want the time {event['occurred_at']}")

    return {
        "outbox-event-id": value("outbox-event-id", event["id"]),
        "outbox-event-type": value("outbox-event-type", event["event_type"]),
        "outbox-aggregate-type": value("outbox-aggregate-type", event["aggregate_type"]),
        "outbox-aggregate-id": value("outbox-aggregate-id", event["aggregate_id"]),
        "outbox-occurred-at": occurred,
        "outbox-idempotency-key": value("outbox-idempotency-key", event.get("idempotency_key")),
    }


def check_routing_headers(where, doc, event, headers):
    rows = table_after(section(doc, "Common to every broker destination"), "**Routing headers**")
    run_checks(where, rows, routing_header_checks(event), headers)
    for name, want in event["headers"].items():
        # HTTP header names have no case (the receiver lower-cases them); elsewhere exact.
        got = headers.get(name, headers.get(name.lower()) if where.startswith("webhook") else None)
        expect(where, f"writer header {name}", got, want)


def ce_attribute_checks(event, variant):
    prefix = variant.get("cloudevents_type_prefix")
    want_type = event["event_type"] if not prefix else f"{prefix.rstrip('.')}.{event['event_type']}"

    def attr(name, want):
        def check(where, ce):
            expect(where, name, ce.get_attributes().get(name), want)

        return check

    def time_attr(where, ce):
        got = ce.get_attributes().get("time")
        want = parse_time(event["occurred_at"])
        if got != want:
            fail(where, f"time is {got!r}, want {want}")

    def extensions(where, ce):
        attrs = ce.get_attributes()
        for name, value in event["headers"].items():
            ext = re.sub(r"[^a-z0-9]", "", name.lower())
            expect(where, f"extension {ext} (header {name})", attrs.get(ext), value)

    return {
        "specversion": attr("specversion", "1.0"),
        "id": attr("id", event["id"]),
        "source": attr("source", variant["cloudevents_source"]),
        "type": attr("type", want_type),
        "subject": attr("subject", event["aggregate_id"]),
        "time": time_attr,
        "datacontenttype": attr("datacontenttype", "application/json"),
        "partitionkey": attr("partitionkey", event["aggregate_id"]),
        "aggregatetype": attr("aggregatetype", event["aggregate_type"]),
        "idempotencykey": attr("idempotencykey", event.get("idempotency_key")),
        "extensions": extensions,
    }


def check_cloudevent(where, doc, event, variant, ce):
    rows = table_after(section(doc, "CloudEvents"), "| attribute |")
    run_checks(where, rows, ce_attribute_checks(event, variant), ce)
    expect(where, "data", ce.get_data(), json.loads(event["payload"]))


def body_check(doc, event, variant, parse_ce):
    """The check of a body: raw bytes, or a CloudEvent the SDK parsed (`parse_ce()`)."""

    def check(where, body):
        if variant["format"] == "raw":
            expect(where, "body", body, event["payload"].encode())
            return
        if variant.get("cloudevents_mode") == "binary":
            expect(where, "body (binary mode: the payload bytes)", body, event["payload"].encode())
        check_cloudevent(where, doc, event, variant, parse_ce())

    return check


def content_type(variant):
    if variant["format"] == "cloudevents" and variant.get("cloudevents_mode") != "binary":
        return "application/cloudevents+json"
    return "application/json"


def in_run(where, name, seconds, started):
    now = time.time()
    if not (started - 5 <= seconds <= now + 5):
        fail(where, f"{name} {seconds} is not within this run ({started}..{now})")


# --- Kafka ---------------------------------------------------------------------------------------


def read_kafka(topic, want):
    consumer = Consumer({"bootstrap.servers": KAFKA, "group.id": f"wire-{topic}",
                         "enable.auto.commit": False})
    try:
        meta = consumer.list_topics(topic, timeout=10)
        parts = meta.topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        out = []
        deadline = time.time() + 30
        while len(out) < want and time.time() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                out.append(msg)
        return out
    finally:
        consumer.close()


def check_kafka(doc, variant, events, started):
    where0 = f"kafka {variant['name']}"
    topic = variant["topic"]
    messages = {}
    for msg in read_kafka(topic, len(events)):
        headers = {k: v.decode() for k, v in (msg.headers() or [])}
        messages[headers.get("outbox-event-id")] = (msg, headers)
    rows = table_after(section(doc, "Kafka"), "| part |")
    for event, where, (msg, headers) in received_events(where0, events, messages, "not read from the topic"):

        def parse_ce(msg=msg):
            if variant.get("cloudevents_mode") == "binary":
                return ce_kafka.from_binary(
                    ce_kafka.KafkaMessage(headers=dict(msg.headers()), key=msg.key(), value=msg.value()),
                    JSONFormat())
            return ce_kafka.from_structured(
                ce_kafka.KafkaMessage(headers=dict(msg.headers()), key=msg.key(), value=msg.value()),
                JSONFormat())

        def headers_check(w, headers=headers, event=event):
            expect(w, "content-type", headers.get("content-type"), content_type(variant))
            check_routing_headers(w, doc, event, headers)

        def timestamp_check(w, msg=msg):
            kind, ms = msg.timestamp()
            expect(w, "timestamp type", kind, TIMESTAMP_CREATE_TIME)
            in_run(w, "record timestamp", ms / 1000, started)

        checks = {
            "topic": lambda w, m=msg: expect(w, "topic", m.topic(), topic),
            "key": lambda w, m=msg, e=event: expect(w, "key", m.key(), e["aggregate_id"].encode()),
            "partition": NOT_OBSERVABLE,  # the Java client's murmur2: not recomputed here
            "value": lambda w, m=msg, e=event: body_check(doc, e, variant, parse_ce)(w, m.value()),
            "headers": headers_check,
            "timestamp (CreateTime)": timestamp_check,
            "limits": NOT_OBSERVABLE,  # a size limit: nothing on a message shows it
        }
        run_checks(where, rows, checks)


# --- RabbitMQ ------------------------------------------------------------------------------------


def rabbit_setup(tag, variants):
    conn = pika.BlockingConnection(pika.URLParameters(RABBITMQ))
    ch = conn.channel()
    ch.exchange_declare(exchange=f"wire_{tag}", exchange_type="topic", auto_delete=False)
    for v in variants:
        if v["type"] == "rabbitmq":
            ch.queue_declare(queue=f"wire_{tag}_{v['name']}", auto_delete=False)
            ch.queue_bind(queue=f"wire_{tag}_{v['name']}", exchange=f"wire_{tag}",
                          routing_key=f"{v['name']}.#")
    return conn


def check_rabbitmq(doc, conn, tag, variant, events, started):
    where0 = f"rabbitmq {variant['name']}"
    ch = conn.channel()
    queue = f"wire_{tag}_{variant['name']}"
    messages = {}
    deadline = time.time() + 30
    while len(messages) < len(events) and time.time() < deadline:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            time.sleep(0.1)
            continue
        messages[props.message_id] = (method, props, body)
    ch.queue_delete(queue)
    rows = table_after(section(doc, "RabbitMQ"), "| part |")
    for event, where, (method, props, body) in received_events(where0, events, messages, "not read from the queue"):
        headers = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in (props.headers or {}).items()}

        def parse_ce(props=props, body=body, headers=headers):
            msg = ce_rabbitmq.RabbitMQMessage(
                headers={k: str(v) for k, v in headers.items()},
                content_type=props.content_type, body=body)
            if variant.get("cloudevents_mode") == "binary":
                return ce_rabbitmq.from_binary(msg, JSONFormat())
            return ce_rabbitmq.from_structured(msg, JSONFormat())

        def properties(w, props=props, event=event):
            expect(w, "message_id", props.message_id, event["id"])
            expect(w, "content_type", props.content_type, content_type(variant))
            expect(w, "type", props.type, event["event_type"])
            expect(w, "timestamp", props.timestamp, int(parse_time(event["occurred_at"]).timestamp()))
            expect(w, "app_id", props.app_id, "outbox-relay")
            expect(w, "delivery_mode", props.delivery_mode, 2)

        def headers_check(w, headers=headers, event=event):
            check_routing_headers(w, doc, event, {k: v for k, v in headers.items() if isinstance(v, str)})
            want_ms = int(parse_time(event["occurred_at"]).timestamp() * 1000)
            expect(w, "timestamp_in_ms", headers.get("timestamp_in_ms"), want_ms)

        checks = {
            "exchange": lambda w, m=method: expect(w, "exchange", m.exchange, f"wire_{tag}"),
            "routing key": lambda w, m=method, e=event: expect(
                w, "routing key", m.routing_key, f"{variant['name']}.{e['event_type']}"),
            "body": lambda w, b=body, e=event, p=parse_ce: body_check(doc, e, variant, p)(w, b),
            "properties": properties,
            "headers": headers_check,
            "flags": lambda w, m=method: expect(w, "redelivered", m.redelivered, False),
            "limits": NOT_OBSERVABLE,
        }
        run_checks(where, rows, checks)


# --- NATS ----------------------------------------------------------------------------------------


async def nats_setup(tag):
    nc = await nats.connect(NATS)
    js = nc.jetstream()
    try:
        await js.delete_stream(f"WIRE_{tag}")
    except Exception:
        pass
    await js.add_stream(name=f"WIRE_{tag}", subjects=[f"wire_{tag}.>"])
    await nc.close()


async def read_nats(tag):
    nc = await nats.connect(NATS)
    js = nc.jetstream()
    info = await js.stream_info(f"WIRE_{tag}")
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        out.append(await js.get_msg(f"WIRE_{tag}", seq))
    await js.delete_stream(f"WIRE_{tag}")
    await nc.close()
    return out


def check_nats(doc, all_messages, tag, variant, events):
    where0 = f"nats {variant['name']}"
    messages = {}
    for m in all_messages:
        if m.subject.startswith(f"wire_{tag}.{variant['name']}."):
            messages[(m.headers or {}).get("Nats-Msg-Id")] = m
    rows = table_after(section(doc, "NATS JetStream"), "| part |")
    for event, where, m in received_events(where0, events, messages, "not in the stream"):
        headers = dict(m.headers or {})

        def parse_ce(m=m, headers=headers):
            return ce_http.from_http(ce_http.HTTPMessage(headers=headers, body=m.data), JSONFormat())

        def headers_check(w, headers=headers, event=event):
            expect(w, "content-type", headers.get("content-type"), content_type(variant))
            expect(w, "Nats-Msg-Id", headers.get("Nats-Msg-Id"), event["id"])
            check_routing_headers(w, doc, event, headers)

        checks = {
            "subject": lambda w, m=m, e=event: expect(
                w, "subject", m.subject, f"wire_{tag}.{variant['name']}.{e['event_type']}"),
            "body": lambda w, m=m, e=event, p=parse_ce: body_check(doc, e, variant, p)(w, m.data),
            "headers": headers_check,
            "timestamp": NOT_OBSERVABLE,  # the relay sets none: JetStream's own time is not ours
            "limits": NOT_OBSERVABLE,
        }
        run_checks(where, rows, checks)


# --- Redis ---------------------------------------------------------------------------------------


def check_redis(doc, tag, variant, events):
    where0 = f"redis {variant['name']}"
    r = redis.Redis.from_url(REDIS)
    key = f"wire:{tag}:{variant['name']}"
    entries = r.xrange(key)
    r.delete(key)
    by_id = {}
    for _, fields in entries:
        fields = {k.decode(): v for k, v in fields.items()}
        by_id[fields["id"].decode()] = fields
    rows = table_after(section(doc, "Redis Streams"), "| field |")
    for event, where, f in received_events(where0, events, by_id, "not in the stream"):
        text = {k: v.decode() for k, v in f.items()}

        def parse_ce(f=f):
            return ce_http.from_structured(
                ce_http.HTTPMessage(headers={"content-type": "application/cloudevents+json"},
                                    body=f["payload"]), JSONFormat())

        def headers_field(w, text=text, event=event):
            check_routing_headers(w, doc, event, json.loads(text["headers"]))

        def occurred(w, text=text, event=event):
            if parse_time(text["occurred_at"]) != parse_time(event["occurred_at"]):
                fail(w, f"occurred_at is {text['occurred_at']}, want {event['occurred_at']}")

        checks = {
            "id": lambda w, t=text, e=event: expect(w, "id", t["id"], e["id"]),
            "type": lambda w, t=text, e=event: expect(w, "type", t["type"], e["event_type"]),
            "key": lambda w, t=text, e=event: expect(w, "key", t["key"], e["aggregate_id"]),
            "aggregate_type": lambda w, t=text, e=event: expect(
                w, "aggregate_type", t["aggregate_type"], e["aggregate_type"]),
            "occurred_at": occurred,
            "idempotency_key": lambda w, t=text, e=event: expect(
                w, "idempotency_key", t.get("idempotency_key"), e.get("idempotency_key")),
            "headers": headers_field,
            "payload": lambda w, f=f, e=event, p=parse_ce: body_check(doc, e, variant, p)(w, f["payload"]),
        }
        run_checks(where, rows, checks)


# --- webhook -------------------------------------------------------------------------------------

received = []


class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        received.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def check_webhook(doc, variant, events, started):
    where0 = f"webhook {variant['name']}"
    by_id = {}
    for path, headers, body in received:
        if path.startswith(f"/{variant['name']}/"):
            by_id[headers.get("outbox-event-id")] = (path, headers, body)
    rows = table_after(section(doc, "Webhook"), "| header (lower case on the wire) |")
    for event, where, (path, headers, body) in received_events(where0, events, by_id, "no request received"):
        expect(where, "path", path, f"/{variant['name']}/{event['event_type']}")
        body_check(doc, event, variant, lambda h=headers, b=body: ce_http.from_http(
            ce_http.HTTPMessage(headers=h, body=b), JSONFormat()))(where + " [body]", body)

        def std_webhooks(w, headers=headers, body=body, event=event):
            if variant.get("signing") != "standard-webhooks":
                for h in ("webhook-id", "webhook-timestamp", "webhook-signature"):
                    expect(w, h, headers.get(h), None)
                return
            Webhook(variant["secret"]).verify(body, headers)  # raises on a bad signature
            expect(w, "webhook-id", headers.get("webhook-id"), event["id"])
            in_run(w, "webhook-timestamp", int(headers["webhook-timestamp"]), started)

        def outbox_v1(w, headers=headers):
            sig = headers.get("x-outbox-signature")
            if variant.get("signing") == "standard-webhooks":
                expect(w, "x-outbox-signature", sig, None)
            elif not re.fullmatch(r"t=\d+,v1=[0-9a-f]{64}", sig or ""):
                fail(w, f"x-outbox-signature is {sig!r}")

        def legacy(w, headers=headers, event=event):
            want = variant.get("legacy_headers", False)
            expect(w, "x-event-id", headers.get("x-event-id"), event["id"] if want else None)
            expect(w, "x-event-type", headers.get("x-event-type"), event["event_type"] if want else None)

        checks = {
            "content-type": lambda w, h=headers: expect(w, "content-type", h.get("content-type"),
                                                        content_type(variant)),
            "idempotency-key": lambda w, h=headers, e=event: expect(
                w, "idempotency-key", h.get("idempotency-key"), e.get("idempotency_key") or e["id"]),
            "x-event-id, x-event-type (legacy_headers = true only)": legacy,
            "routing headers": lambda w, h=headers, e=event: check_routing_headers(w, doc, e, h),
            "authorization": lambda w, h=headers: expect(w, "authorization", h.get("authorization"), None),
            "x-outbox-signature (default signature_scheme = \"outbox-v1\", name set by signature_header)": outbox_v1,
            "webhook-id, webhook-timestamp, webhook-signature (signature_scheme = \"standard-webhooks\")": std_webhooks,
            "user-agent": lambda w, h=headers: None if (h.get("user-agent") or "").startswith(
                "outbox-relay/") else fail(w, f"user-agent is {h.get('user-agent')!r}"),
        }
        run_checks(where, rows, checks)


# --- main ----------------------------------------------------------------------------------------


def main():
    import asyncio

    doc_path, tag = sys.argv[1], sys.argv[2]
    doc = open(doc_path, encoding="utf-8").read()
    started = time.time()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    variants_hint = json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
    conn = rabbit_setup(tag, variants_hint)
    asyncio.run(nats_setup(tag))
    print(f"ready {server.server_address[1]}", flush=True)

    spec_path = sys.stdin.readline().strip()
    if not spec_path:
        raise SystemExit("no expectations given on stdin")
    spec = json.load(open(spec_path, encoding="utf-8"))
    nats_messages = asyncio.run(read_nats(tag))
    deadline = time.time() + 30
    want_requests = sum(len(v["events"]) for v in spec if v["type"] == "webhook")
    while len(received) < want_requests and time.time() < deadline:
        time.sleep(0.1)

    checked = 0
    for variant in spec:
        events = variant["events"]
        kind = variant["type"]
        if kind == "kafka":
            check_kafka(doc, variant, events, started)
        elif kind == "rabbitmq":
            check_rabbitmq(doc, conn, tag, variant, events, started)
        elif kind == "nats":
            check_nats(doc, nats_messages, tag, variant, events)
        elif kind == "redis":
            check_redis(doc, tag, variant, events)
        elif kind == "webhook":
            check_webhook(doc, variant, events, started)
        else:
            fail(variant["name"], f"unknown destination type {kind}")
        checked += len(events)
    conn.channel().exchange_delete(f"wire_{tag}")
    conn.close()
    server.shutdown()
    if failures:
        print(f"{len(failures)} mismatches between the wire and docs/wire-format.md:")
        for f in failures:
            print(f"  {f}")
        sys.exit(1)
    print(f"ok: {checked} messages over {len(spec)} destinations match docs/wire-format.md")


if __name__ == "__main__":
    main()
